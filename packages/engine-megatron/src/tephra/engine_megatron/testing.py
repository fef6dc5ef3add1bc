"""Test helpers: tiny HF configs, the single-process transformers reference, and the
conformance spec of this backend (used by this package's tests and by cross-backend tests)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tephra.engine_api.config import EngineConfig, apply_overrides

TINY_DENSE: dict[str, Any] = dict(
    model_type="qwen2",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
"""A tiny Qwen2 (GQA, qkv bias, SwiGLU): 4 layers so that PP=2 with 2 virtual stages fits."""

TINY_MOE: dict[str, Any] = dict(
    model_type="qwen2_moe",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    norm_topk_prob=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
"""A tiny Qwen2-MoE: 4 experts, top-2, a gated shared expert."""


def base_config(
    hf_config: dict[str, Any], parallel: dict[str, Any] | None = None, **sections: Any
) -> EngineConfig:
    """fp32, lr 1e-2 (one step visibly lowers the loss), no clipping surprises."""
    return EngineConfig(
        model={"hf_config": dict(hf_config), "init_seed": 0},
        optimizer={"lr": 1e-2, "weight_decay": 0.0, "grad_clip": 1.0},
        micro_batch={"max_tokens_per_microbatch": 4096},
        parallel=parallel or {},
        **sections,
    )


class HFReference:
    """Plain transformers model (single process, eager attention) with the engine's initial
    weights; implements the conformance kit's `ReferenceModel`."""

    def __init__(self, hf_config: dict[str, Any], init_seed: int = 0) -> None:
        import transformers

        from tephra.engine_megatron.hf_loading import reference_model

        data = dict(hf_config)
        cfg = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
        self.model = reference_model(cfg, init_seed)
        self.model.eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = dict(weights)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = self.model.config.tie_word_embeddings
        missing = [m for m in missing if not (tied and m == "lm_head.weight")]
        assert not missing and not unexpected, f"missing {missing}, unexpected {unexpected}"

    def logits(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        with torch.no_grad():
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
            ).logits.float()


def conformance_spec(
    hf_config: dict[str, Any], parallel: dict[str, Any], workdir: Path, dispatcher: str = "alltoall"
):
    from tephra.engine_api.testing import ConformanceSpec
    from tephra.engine_megatron.engine import MegatronEngine

    base = base_config(hf_config, {**parallel, "moe_token_dispatcher": dispatcher})
    return ConformanceSpec(
        make_engine=lambda overrides: MegatronEngine.build(apply_overrides(base, overrides)),
        make_reference=lambda: HFReference(hf_config),
        vocab_size=hf_config["vocab_size"],
        workdir=Path(workdir),
        atol=1e-5,
    )


# ----- functions run on every rank by `run_distributed` (must be importable) --------------
def rank_conformance(
    hf_config: dict[str, Any],
    parallel: dict[str, Any],
    workdir: str,
    dispatcher: str = "alltoall",
    checks: list[str] | None = None,
) -> list[str]:
    """Run the conformance kit on this rank; returns the names of the checks that passed."""
    from tephra.engine_api.testing import run_conformance

    return run_conformance(conformance_spec(hf_config, parallel, Path(workdir), dispatcher), checks)


def rank_conformance_runs(
    runs: list[tuple[str, dict[str, Any], str, list[str] | None]], workdir: str
) -> list[list[str]]:
    """Several kit runs in one process group (megatron's groups are rebuilt between layouts):
    each run is (model: "dense" | "dense_tied" | "moe", parallel overrides, MoE dispatcher,
    checks or None)."""
    models = {
        "dense": TINY_DENSE,
        "moe": TINY_MOE,
        "dense_tied": {**TINY_DENSE, "tie_word_embeddings": True},
    }
    return [
        rank_conformance(models[m], parallel, str(Path(workdir) / f"run{i}"), disp, checks)
        for i, (m, parallel, disp, checks) in enumerate(runs)
    ]


def rank_first_step(model_path: str, parallel: dict[str, Any], batch, export_to: str | None):
    """Build through the registry from an HF folder, take one step on `batch` (every rank
    gets the same batch: pure model parallelism), optionally export_hf; returns
    (loss, grad norm, forward outputs before the step)."""
    from tephra.engine_api import get_engine
    from tephra.engine_api.testing import nll_loss_fn

    config = EngineConfig(
        model={"path": model_path},
        optimizer={"lr": 1e-2, "weight_decay": 0.0, "grad_clip": 1.0},
        parallel=parallel,
    )
    engine = get_engine("megatron", config)
    with engine.eval_mode():
        out = engine.forward(batch)
    if export_to is not None:
        engine.export_hf(export_to)
    with engine.train_mode():
        metrics = engine.forward_backward(batch, nll_loss_fn)
        norm = engine.optimizer_step()
    return metrics["loss"], norm, {k: out[k] for k in out.keys()}


def rank_dp_steps(
    hf_config: dict[str, Any],
    batch,
    workdir: str,
    steps: int = 3,
    save_after: int = 2,
    parallel: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Data parallelism over the ranks that `parallel` leaves (all of them by default; a world
    of one gives the DP=1 reference):
    `steps` AdamW steps (cosine lr) on this rank's contiguous share of `batch`, a checkpoint
    after `save_after` steps; then a fresh engine loads it and takes the remaining steps.
    Returns per-step losses and grad norms, the final HF weights, this rank's optimizer slice
    size (`local_numel`), the model's parameter count on this rank (`param_numel`), `dp_size`,
    and the
    resumed run's losses, norms and weights (`resumed_*`). Weights are numpy arrays: they
    pickle by value (torch tensors cross the result queue as shared memory of a process that
    may already have exited)."""
    from tephra.engine_api import batch as B
    from tephra.engine_api.testing import nll_loss_fn
    from tephra.engine_megatron.engine import MegatronEngine

    # lr 1e-3: Adam's step direction g / (sqrt(v) + eps) of an entry whose gradient is near
    # eps amplifies fp32 summation-order differences (DP=2 adds two shares' gradients, DP=1
    # one); the weight difference scales with lr, and 1e-3 keeps it well under 1e-5
    config = apply_overrides(
        base_config(
            hf_config,
            parallel,
            scheduler={"name": "cosine", "total_steps": steps + 1, "min_lr_ratio": 0.1},
        ),
        {"optimizer.lr": 1e-3},
    )

    def step(engine) -> tuple[float, float]:
        rows = batch.batch_size[0] // engine.dp_size
        share = B.trim_padding(batch[engine.dp_rank * rows : (engine.dp_rank + 1) * rows])
        with engine.train_mode():
            loss = engine.forward_backward(share, nll_loss_fn)["loss"]
            norm = engine.optimizer_step()
            engine.lr_scheduler_step()
        return loss, norm

    engine = MegatronEngine.build(config)
    out: dict[str, Any] = {
        "local_numel": engine.optimizer.local_numel(),
        "param_numel": sum(p.numel() for c in engine.chunks for p in c.parameters()),
        "dp_size": engine.dp_size,
    }
    results = []
    for i in range(steps):
        if i == save_after:
            engine.save_checkpoint(Path(workdir) / "ck")
        results.append(step(engine))
    out["losses"], out["norms"] = [r[0] for r in results], [r[1] for r in results]
    out["weights"] = {k: v.numpy() for k, v in engine.hf_weights().items()}
    resumed = MegatronEngine.build(config)
    resumed.load_checkpoint(Path(workdir) / "ck")
    results = [step(resumed) for _ in range(save_after, steps)]
    out["resumed_losses"], out["resumed_norms"] = [r[0] for r in results], [r[1] for r in results]
    out["resumed_weights"] = {k: v.numpy() for k, v in resumed.hf_weights().items()}
    return out


def rank_sequence(calls: list[tuple[Any, tuple]]) -> list[Any]:
    """Several rank functions `(fn, args)` one after the other in one process group (saves a
    process start, ~10 s of importing megatron per rank, per call)."""
    return [fn(*args) for fn, args in calls]
