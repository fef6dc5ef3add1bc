"""The JSON bodies of the remote environment protocol (`serve` answers them, `remote` sends
them): a prompt item, a step's result with its images as PNG, and values a body can carry."""

from __future__ import annotations

import base64
import io
import json
from dataclasses import fields
from typing import Any

import torch

from tephra.episodes.environments.base import StepResult
from tephra.episodes.prompt import Prompt
from tephra.rollout.multimodal import MultimodalInputs

ITEM_FIELDS = (
    "messages",
    "data_source",
    "ground_truth",
    "sample_id",
    "prompt_ids",
    "tools",
    "tool_kwargs",
    "extra_info",
    "interaction_kwargs",
    "agent_name",
    "origin",
    "multimodal",
)
"""The `Prompt` fields sent to the server; its images (`multimodal`: the tensors of the
policy's processor) as their raw bytes, so the served environment gets the same pixels, bit
for bit (`multimodal_to_json`)."""


def _plain(value: Any) -> Any:
    """`json.dumps`'s fallback: numpy values and arrays (parquet rows hold them) as their
    Python values, anything else as its text."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def dumps(body: dict[str, Any]) -> bytes:
    """A body as JSON bytes (NaN and infinities allowed, as Python's json reads them)."""
    return json.dumps(body, default=_plain).encode()


def item_to_json(item: Prompt) -> dict[str, Any]:
    data = {name: getattr(item, name) for name in ITEM_FIELDS}
    data["multimodal"] = multimodal_to_json(item.multimodal)
    return data


def item_from_json(data: dict[str, Any]) -> Prompt:
    unknown = sorted(set(data) - set(ITEM_FIELDS))
    if unknown:
        raise ValueError(f"item has fields {unknown}; an item has {list(ITEM_FIELDS)}")
    return Prompt(**{**data, "multimodal": multimodal_from_json(data.get("multimodal"))})


def tensor_to_json(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as its dtype, shape and raw bytes (base64): exact for every dtype, bfloat16
    included (no text or float round trip)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "data": base64.b64encode(raw).decode("ascii"),
    }


def tensor_from_json(data: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, str(data["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor dtype {data['dtype']!r} is not a torch dtype")
    raw = bytearray(base64.b64decode(data["data"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(data["shape"])


def multimodal_to_json(inputs: MultimodalInputs | None) -> dict[str, Any] | None:
    """A prompt's images (and videos): each tensor field of `MultimodalInputs` by name."""
    if inputs is None:
        return None
    return {
        f.name: None if getattr(inputs, f.name) is None else tensor_to_json(getattr(inputs, f.name))
        for f in fields(inputs)
    }


def multimodal_from_json(data: dict[str, Any] | None) -> MultimodalInputs | None:
    if data is None:
        return None
    tensors = {k: None if v is None else tensor_from_json(v) for k, v in data.items()}
    pixels = tensors.pop("pixel_values")
    if pixels is None:
        raise ValueError("multimodal.pixel_values is null; a prompt's images need their pixels")
    return MultimodalInputs(pixels, **tensors)


def image_to_json(image: Any) -> dict[str, str]:
    """A PIL image as lossless PNG (its mode kept), base64."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"png": base64.b64encode(buffer.getvalue()).decode("ascii")}


def image_from_json(data: dict[str, str]) -> Any:
    # PIL only here: text-only environments send no images
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(data["png"])))
    image.load()
    return image


def result_to_json(result: StepResult) -> dict[str, Any]:
    return {
        "observation": result.observation,
        "reward": float(result.reward),
        "done": bool(result.done),
        "info": result.info,
        "images": [image_to_json(i) for i in result.images],
    }


def result_from_json(data: dict[str, Any]) -> StepResult:
    return StepResult(
        observation=list(data.get("observation") or []),
        reward=float(data.get("reward", 0.0)),
        done=bool(data.get("done", False)),
        images=[image_from_json(i) for i in data.get("images") or []],
        info=dict(data.get("info") or {}),
    )
