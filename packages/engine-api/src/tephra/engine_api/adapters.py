"""A LoRA adapter in memory: what an engine hands the rollout instead of the merged weights.

The update of an adapted linear layer is W' = W + (alpha / rank) * B @ A (A: [rank, in],
B: [out, rank]). The tensors are named as peft saves them (`adapter_model.safetensors`):
`base_model.model.<module>.lora_A.weight` and `...lora_B.weight`, where `<module>` is the
adapted linear layer's Hugging Face name, so any peft-compatible loader (peft itself, vLLM,
SGLang) takes them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PEFT_PREFIX = "base_model.model."
"""The prefix peft puts before a module's Hugging Face name in an adapter's file."""


@dataclass(frozen=True)
class LoraAdapter:
    """The adapter's config and full (unsharded) matrices."""

    rank: int
    """r: the inner dimension of A and B."""
    alpha: float
    """lora_alpha: the update is scaled by alpha / rank."""
    tensors: dict[str, torch.Tensor]
    """peft-named A and B matrices (see the module docstring), float32 on the CPU."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoraAdapter.rank={self.rank} must be >= 1")
        bad = [n for n in self.tensors if not _is_peft_name(n)]
        if bad:
            raise ValueError(
                f"LoraAdapter: {bad[:3]} are not peft adapter names "
                f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)"
            )

    @property
    def scaling(self) -> float:
        """alpha / rank."""
        return self.alpha / self.rank

    @property
    def modules(self) -> list[str]:
        """The adapted modules' Hugging Face names, sorted."""
        return sorted({n[len(PEFT_PREFIX) :].rsplit(".lora_", 1)[0] for n in self.tensors})

    @property
    def target_modules(self) -> list[str]:
        """The adapted modules' last name parts (`q_proj`, ...), as peft's `target_modules`."""
        return sorted({m.rsplit(".", 1)[-1] for m in self.modules})

    @property
    def nbytes(self) -> int:
        """Bytes of the matrices (what a sync moves)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def config_dict(self, base_model_path: str | None = None) -> dict[str, object]:
        """`adapter_config.json` as peft writes it (the fields its loaders read)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": self.target_modules,
            "base_model_name_or_path": base_model_path,
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
        }


def _is_peft_name(name: str) -> bool:
    return name.startswith(PEFT_PREFIX) and name.endswith((".lora_A.weight", ".lora_B.weight"))
