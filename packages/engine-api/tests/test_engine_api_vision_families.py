"""The vision-family adapters: chosen by `model_type`, an unknown one refused naming the
supported ones; LLaVA's token count is patches per side squared (+1 with the CLS feature);
whole images and patch rows with grids are never mixed."""

from __future__ import annotations

import pytest
import torch
from transformers import LlavaConfig

from tephra.engine_api.errors import ConfigError
from tephra.engine_api.multimodal import (
    VISION_FAMILIES,
    LlavaFamily,
    MultimodalInputs,
    QwenVLFamily,
    check_image_tokens,
    vision_family,
)


def _llava(strategy: str = "default") -> LlavaConfig:
    return LlavaConfig(
        vision_config={"model_type": "clip_vision_model", "image_size": 56, "patch_size": 14},
        text_config={"model_type": "llama"},
        image_token_index=7,
        vision_feature_select_strategy=strategy,
    )


def test_the_family_follows_the_model_type():
    assert isinstance(vision_family({"model_type": "qwen2_5_vl"}), QwenVLFamily)
    assert isinstance(vision_family(_llava()), LlavaFamily)
    assert VISION_FAMILIES.names() == ["llava", "qwen2_vl"]
    with pytest.raises(
        ConfigError,
        match=r"model_type 'idefics3' is not supported; supported model types \(family\): "
        r"llava \(llava\), qwen2_vl \(qwen2_vl\), qwen2_5_vl \(qwen2_vl\)",
    ):
        vision_family({"model_type": "idefics3"})


def test_llava_counts_one_token_per_patch():
    images = MultimodalInputs(torch.zeros(2, 3, 56, 56), None)
    assert images.num_images == 2
    assert vision_family(_llava()).image_token_counts(images, _llava()) == [16, 16]
    full = _llava("full")  # the CLS feature kept: one more token an image
    assert vision_family(full).image_token_counts(images, full) == [17, 17]
    check_image_tokens([1] + [7] * 32 + [2], images, _llava(), "row 3")
    with pytest.raises(
        ConfigError, match="row 3: the prompt holds 31 image tokens but its images need 32"
    ):
        check_image_tokens([7] * 31, images, _llava(), "row 3")


def test_whole_images_and_grids_are_not_mixed():
    with pytest.raises(
        ConfigError, match=r"no image_grid_thw; without a grid \(LLaVA\) pass whole"
    ):
        MultimodalInputs(torch.zeros(16, 1176), None)
    qwen = MultimodalInputs(torch.zeros(4, 1176), torch.tensor([[1, 2, 2]]))
    llava = MultimodalInputs(torch.zeros(1, 3, 56, 56), None)
    with pytest.raises(ConfigError, match="some prompts' images have grids and some do not"):
        MultimodalInputs.concat([qwen, llava])
    assert MultimodalInputs.concat([llava, llava]).pixel_values.shape == (2, 3, 56, 56)


def test_trimming_a_micro_batch_keeps_its_images():
    # a micro-batch none of whose rows is as long as the batch is trimmed of its padding
    # columns; its images must stay (they were dropped, and the rows scored as text)
    from tensordict import TensorDict

    from tephra.engine_api.batch import ATTENTION_MASK, INPUT_IDS, trim_padding
    from tephra.engine_api.multimodal import MULTIMODAL, multimodal_column

    images = [MultimodalInputs(torch.full((1, 3, 56, 56), float(i)), None) for i in range(2)]
    attn = torch.tensor([[1] * 7 + [0] * 3, [1] * 5 + [0] * 5])
    batch = TensorDict({INPUT_IDS: torch.ones(2, 10, dtype=torch.long), ATTENTION_MASK: attn}, [2])
    batch[MULTIMODAL] = multimodal_column(images)
    trimmed = trim_padding(batch)
    assert trimmed[INPUT_IDS].shape == (2, 7)
    assert [float(m.pixel_values[0, 0, 0, 0]) for m in trimmed[MULTIMODAL].tolist()] == [0.0, 1.0]
