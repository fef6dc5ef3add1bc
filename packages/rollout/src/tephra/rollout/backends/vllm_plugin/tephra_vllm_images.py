"""An ASGI middleware for the vLLM server that turns tephra's image requests into vLLM's own
token-in/token-out request with preprocessed multimodal features.

vLLM's `/inference/v1/generate` (enabled by `--enable-scale-out`) takes token ids together with
`features`: each image's placeholder range in the token ids and its processed tensors as a
base64 msgpack `MultiModalKwargsItem`. That encoding is vLLM's own, so tephra's client (which
does not import vLLM) sends `POST /tephra/generate` with the same body but `images`: the pixel
tensors the model's image processor made (raw bytes + dtype + shape, base64) and each image's
placeholder range and hash. This middleware builds the items with the model's multimodal
processor field layout (`_get_mm_fields_config`, vLLM 0.32) and forwards the request to
`/inference/v1/generate`. The token ids are used as given (already expanded placeholders;
vLLM does not expand them again), and the pixels as given (no second image processing; the
server runs with `--no-mm-device-do-normalize`, since vLLM 0.32 otherwise takes uint8 pixels
and normalises them on the device).
Loaded with `--middleware tephra_vllm_images.TephraImages`; imports only vLLM's stack.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch
from transformers import BatchFeature
from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import encode_mm_kwargs_item
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalKwargsItems

PATH = "/tephra/generate"
TARGET = "/inference/v1/generate"


def decode_tensor(spec: dict[str, Any]) -> torch.Tensor:
    """A tensor sent as `{"data": base64 bytes, "dtype": "float32", "shape": [...]}`."""
    raw = bytearray(base64.b64decode(spec["data"]))
    dtype = getattr(torch, spec["dtype"])
    return torch.frombuffer(raw, dtype=dtype).reshape(spec["shape"]).clone()


class TephraImages:
    """Rewrite `POST /tephra/generate` (tephra's image request) into vLLM's generate request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._processor: Any = None

    def _features(self, app: Any, images: dict[str, Any]) -> dict[str, Any]:
        if self._processor is None:
            model_config = app.state.engine_client.vllm_config.model_config
            if getattr(model_config.multimodal_config, "mm_device_do_normalize", False):
                raise ValueError(
                    "the server normalises pixels on the device and tephra sends them "
                    "normalised by the model's processor; start it with "
                    "--no-mm-device-do-normalize"
                )
            self._processor = MULTIMODAL_REGISTRY.create_processor(model_config)
        tensors = BatchFeature({k: decode_tensor(v) for k, v in images["tensors"].items()})
        fields = self._processor._get_mm_fields_config(tensors, {})
        items = MultiModalKwargsItems.from_hf_inputs(tensors, fields)["image"]
        if len(items) != len(images["placeholders"]):
            raise ValueError(
                f"{len(items)} images in the tensors, {len(images['placeholders'])} placeholders"
            )
        return {
            "mm_hashes": {"image": list(images["hashes"])},
            "mm_placeholders": {
                "image": [{"offset": o, "length": n} for o, n in images["placeholders"]]
            },
            "kwargs_data": {"image": [encode_mm_kwargs_item(item) for item in items]},
        }

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            body = json.loads(b"".join(chunks))
            body["features"] = self._features(scope["app"], body.pop("images"))
        except Exception as exc:  # noqa: BLE001 - the client gets the reason, not a 500
            error = json.dumps({"error": f"tephra image request: {type(exc).__name__}: {exc}"})
            await send(
                {
                    "type": "http.response.start",
                    "status": 400,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": error.encode()})
            return
        data = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(data)).encode()))
        forwarded = dict(scope, path=TARGET, raw_path=TARGET.encode(), headers=headers)
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if sent:
                return await receive()  # the client's disconnect, if it comes
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}

        await self.app(forwarded, replay, send)
