"""Images through the trainer's data path: samples -> the batch's `multimodal` column, which
slicing, row selection and the data-parallel split keep aligned with the rows; a sample's
JSON leaves the pixels out and a pending round gets them back from its prompts; a response
that sampled the image placeholder ends before it."""

from __future__ import annotations

from dataclasses import replace

import torch

from tephra.controller.cluster.dispatch import split_value
from tephra.controller.samples import MULTIMODAL, Prompt, Sample, samples_to_batch
from tephra.controller.step.rounds import Round, round_from_dict, round_to_dict
from tephra.controller.step.skip_flat import skip_zero_advantage_rows
from tephra.controller.workers.generation import end_before_token
from tephra.engine_api.multimodal import MultimodalInputs


def _images(k: int) -> MultimodalInputs:
    return MultimodalInputs(torch.full((4, 6), float(k)), torch.tensor([[1, 2, 2]]))


def _samples() -> list[Sample]:
    mm = [_images(0), None, _images(2), _images(3)]
    return [
        Sample(
            [1, 2, 3][: 2 + k % 2],
            [5] * (k + 1),
            [1] * (k + 1),
            [-0.5] * (k + 1),
            "stop",
            sample_id=f"s{k}",
            multimodal=mm[k],
        )
        for k in range(4)
    ]


def test_batch_column_follows_the_rows():
    samples = _samples()
    batch = samples_to_batch(samples, pad_token_id=0, n=2, multi_turn=False)
    assert batch[MULTIMODAL].tolist() == [s.multimodal for s in samples]
    assert batch[1:3][MULTIMODAL].tolist() == [None, samples[2].multimodal]
    halves = split_value(batch, 2, "batch")
    assert [h[MULTIMODAL].tolist() for h in halves] == [
        [samples[0].multimodal, None],
        [samples[2].multimodal, samples[3].multimodal],
    ]
    batch["advantages"] = torch.zeros(batch["response_mask"].shape)
    batch["advantages"][3] = 1.0
    kept, left_out = skip_zero_advantage_rows(batch)
    assert kept[MULTIMODAL].tolist() == [samples[3].multimodal] and left_out == 3
    # a reordered batch (the token-balanced data-parallel order) carries its images along
    order = torch.tensor([2, 0, 3, 1])
    assert batch[order][MULTIMODAL].tolist() == [samples[k].multimodal for k in (2, 0, 3, 1)]


def test_text_batch_has_no_column():
    samples = [Sample([1], [2], [1], [0.0], "stop")]
    assert MULTIMODAL not in samples_to_batch(samples, 0, 1, False).keys()


def test_pending_round_gets_its_images_back_from_the_prompts():
    samples = _samples()
    items = [
        Prompt([], "src", "x", sample_id="p0", prompt_ids=[1, 2], multimodal=samples[0].multimodal),
        Prompt([], "src", "x", sample_id="p1", prompt_ids=[1, 2], multimodal=samples[2].multimodal),
    ]
    rnd = Round(items, samples, 2, kept_groups=[0, 1], indices=[0, 1], tag="step1")
    data = round_to_dict(rnd)
    assert "multimodal" not in data["samples"][0]
    back = round_from_dict(data, items)
    assert [s.multimodal for s in back.samples] == [items[0].multimodal] * 2 + [
        items[1].multimodal
    ] * 2


class _Decoder:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_response_ends_before_a_sampled_image_placeholder():
    image_token = 9
    sample = Sample(
        [1, 9, 9, 2],
        [5, 6, 9, 7],
        [1] * 4,
        [-0.1, -0.2, -0.3, -0.4],
        "stop",
        text="5 6 9 7",
        multimodal=_images(0),
    )
    cut = end_before_token(sample, image_token, _Decoder())
    assert (cut.response_ids, cut.response_mask, cut.log_probs) == ([5, 6], [1, 1], [-0.1, -0.2])
    assert cut.finish_reason == "image_token" and cut.text == "5 6"
    assert cut.prompt_ids == sample.prompt_ids and cut.multimodal is sample.multimodal
    assert end_before_token(cut, image_token, _Decoder()) is cut
    # a placeholder as the first token leaves an empty response; the batch keeps the prompt's
    # image tokens only
    empty = end_before_token(
        replace(sample, response_ids=[9, 5], response_mask=[1, 1], log_probs=[-0.1, -0.2]),
        image_token,
        _Decoder(),
    )
    batch = samples_to_batch([cut, empty], pad_token_id=0, n=2, multi_turn=False)
    assert (batch["input_ids"] == image_token).sum(-1).tolist() == [2, 2]
    assert batch["response_mask"].sum(-1).tolist() == [2, 0]
