"""Images through the trainer's data path: samples -> the batch's `multimodal` column, which
slicing, row selection and the data-parallel split keep aligned with the rows; a sample's
JSON leaves the pixels out and a pending round gets them back from its prompts."""

from __future__ import annotations

import torch

from tephra.controller.data import PromptRecord
from tephra.controller.dispatch import split_value
from tephra.controller.rl_loop import Round, round_from_dict, round_to_dict
from tephra.controller.rl_worker import skip_zero_advantage_rows
from tephra.controller.samples import MULTIMODAL, PromptItem, Sample, samples_to_batch
from tephra.engine_api.multimodal import MultimodalInputs


def _images(k: int) -> MultimodalInputs:
    return MultimodalInputs(torch.full((4, 6), float(k)), torch.tensor([[1, 2, 2]]))


def _samples() -> list[Sample]:
    mm = [_images(0), None, _images(2), _images(3)]
    return [Sample([1, 2, 3][: 2 + k % 2], [5] * (k + 1), [1] * (k + 1), [-0.5] * (k + 1), "stop",
                   sample_id=f"s{k}", multimodal=mm[k]) for k in range(4)]


def test_batch_column_follows_the_rows():
    samples = _samples()
    batch = samples_to_batch(samples, pad_token_id=0, n=2, multi_turn=False)
    assert batch[MULTIMODAL].tolist() == [s.multimodal for s in samples]
    assert batch[1:3][MULTIMODAL].tolist() == [None, samples[2].multimodal]
    halves = split_value(batch, 2, "batch")
    assert [h[MULTIMODAL].tolist() for h in halves] == [[samples[0].multimodal, None],
                                                       [samples[2].multimodal, samples[3].multimodal]]
    batch["advantages"] = torch.zeros(batch["response_mask"].shape)
    batch["advantages"][3] = 1.0
    kept, _, _ = skip_zero_advantage_rows(batch, lambda o, b: None)
    assert kept[MULTIMODAL].tolist() == [samples[3].multimodal]


def test_text_batch_has_no_column():
    samples = [Sample([1], [2], [1], [0.0], "stop")]
    assert MULTIMODAL not in samples_to_batch(samples, 0, 1, False).keys()


def test_pending_round_gets_its_images_back_from_the_prompts():
    samples = _samples()
    items = [PromptItem([1, 2], PromptRecord([], "src", "x"), "p0", samples[0].multimodal),
             PromptItem([1, 2], PromptRecord([], "src", "x"), "p1", samples[2].multimodal)]
    rnd = Round(items, samples, 2, kept_groups=[0, 1], indices=[0, 1], tag="step1")
    data = round_to_dict(rnd)
    assert "multimodal" not in data["samples"][0]
    back = round_from_dict(data, items)
    assert [s.multimodal for s in back.samples] == [items[0].multimodal] * 2 + [items[1].multimodal] * 2
