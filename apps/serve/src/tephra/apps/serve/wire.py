"""The Tinker SDK's wire format: its protobuf requests and responses to and from plain Python.

The SDK sends `forward_backward` as a protobuf message (zstd-compressed when the server asks
for it; this one does not) and reads `forward_backward` and `sample` results as protobuf
messages; every other call is JSON. The message classes are the SDK's own
(`tinker.proto.tinker_public_pb2`), so the server reads exactly what the client writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from tephra.apps.serve.errors import UserError

_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


@dataclass
class Datum:
    """One training example: the model's input tokens and the loss function's inputs
    (`target_tokens`, `weights`, `logprobs`, `advantages`, each one value per input token)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackwardCall:
    model_id: str
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def _tensor(msg: pb.Tensor, name: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(f"loss_fn_inputs[{name!r}]: dtype {msg.dtype} is not float32 or int64")
    if msg.HasField("sparse_csr"):
        raise UserError(
            f"loss_fn_inputs[{name!r}] is a sparse tensor; tephra serve takes dense ones only"
        )
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()
    return arr.reshape(list(msg.shape)) if len(msg.shape) else arr


def read_forward_backward(body: bytes, content_encoding: str | None) -> ForwardBackwardCall:
    """Decode the body of `POST /api/v1/forward_backward`."""
    if content_encoding == "zstd":
        body = zstandard.ZstdDecompressor().decompress(body)
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise UserError(
                    f"datum {i}: model_input chunk of kind {kind!r}; tephra serve takes "
                    "token chunks (EncodedTextChunk) only"
                )
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: _tensor(t, name) for name, t in d.loss_fn_inputs.items()}
        data.append(Datum(tokens=tokens, inputs=inputs))
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.HasField("number")}
    config.update({k: float(v) for k, v in msg.loss_fn_config.items() if k not in config})
    return ForwardBackwardCall(
        model_id=msg.model_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
        data=data,
    )


def forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """`ForwardBackwardOutput` bytes: per datum, float32 arrays (`logprobs`, ...)."""
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    if outputs:
        record = msg.loss_fn_outputs.add()
        record.num_datums = len(outputs)
        for name in outputs[0]:
            arrays = [np.asarray(o[name], dtype=np.float32).ravel() for o in outputs]
            offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([a.nbytes for a in arrays])
            field = record.fields[name]
            field.data = b"".join(a.tobytes() for a in arrays)
            field.offsets = offsets.tobytes()
            field.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def sample_output(sequences: list[tuple[list[int], list[float], str]]) -> bytes:
    """`SampleResponse` bytes from `(tokens, logprobs, stop_reason)` per sample."""
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()


def prompt_tokens(model_input: dict, where: str) -> list[int]:
    """The tokens of a JSON `ModelInput` (`{"chunks": [{"type": "encoded_text", ...}]}`)."""
    tokens: list[int] = []
    for chunk in model_input.get("chunks", []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(
                f"{where}: chunk of type {chunk.get('type')!r}; tephra serve takes token "
                "chunks (EncodedTextChunk) only"
            )
        tokens.extend(int(t) for t in chunk["tokens"])
    return tokens
