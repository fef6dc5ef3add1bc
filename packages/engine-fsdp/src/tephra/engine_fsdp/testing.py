"""Test helpers for engine-fsdp and its users: a tiny model config, a plain reference model
(the conformance kit's `ReferenceModel`) and the kit's spec for this engine."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig, ModelConfig, OptimizerConfig, apply_overrides
from tephra.engine_api.loss import LossFn, Share
from tephra.engine_api.multimodal import vision_family
from tephra.engine_api.testing import (
    ConformanceSpec,
    ReferenceModel,
    nll_loss_fn,
    random_batch,
    run_conformance,
)
from tephra.engine_fsdp.engine import FSDPEngine

TINY_VOCAB = 256


def tiny_qwen2_config(**overrides: Any) -> dict[str, Any]:
    """A 2-layer Qwen2 (hidden 64, vocab 256) as an `hf_config` dict: builds in milliseconds."""
    cfg = dict(
        model_type="qwen2",
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    cfg.update(overrides)
    return cfg


def tiny_engine_config(**overrides: Any) -> EngineConfig:
    """fp32 tiny policy, lr 1e-2, no clipping limit in the way; dotted overrides applied."""
    base = EngineConfig(
        model=ModelConfig(hf_config=tiny_qwen2_config(), init_seed=0),
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
        device="cpu",
    )
    return apply_overrides(base, overrides)


class HFReference:
    """A plain single-process transformers model: `load_weights` + `logits`."""

    def __init__(self, hf_config: dict[str, Any], init_seed: int = 0) -> None:
        data = dict(hf_config)
        config = AutoConfig.for_model(data.pop("model_type"), **data)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            self.model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation="eager"
            )
        self.model.eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = {name: t.detach().cpu() for name, t in weights}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [
            m for m in missing if m != "lm_head.weight" or not self.model.config.tie_word_embeddings
        ]
        assert not missing and not unexpected, f"missing {missing}, unexpected {unexpected}"

    def load_adapter(self, folder: Path) -> None:
        """Wrap the model in the peft adapter `FSDPEngine.export_adapter` wrote to `folder`."""
        # imported here: peft takes seconds to import and only LoRA checks need it
        from peft import PeftModel

        self.model = PeftModel.from_pretrained(self.model, str(folder)).eval()

    def logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        with torch.no_grad():
            return self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).logits.float()


def _load_adapter(ref: ReferenceModel, folder: Path) -> None:
    """The kit's `load_adapter` for the `HFReference` that `conformance_spec` makes."""
    if not isinstance(ref, HFReference):
        raise TypeError(f"load_adapter expects an HFReference, got {type(ref).__name__}")
    ref.load_adapter(folder)


def conformance_spec(workdir: Path, **base_overrides: Any) -> ConformanceSpec:
    """The conformance kit's spec for this engine on the tiny model."""

    def make_engine(overrides: dict[str, Any]) -> FSDPEngine:
        return FSDPEngine.build(tiny_engine_config(**{**base_overrides, **overrides}))

    return ConformanceSpec(
        make_engine=make_engine,
        make_reference=lambda: HFReference(tiny_qwen2_config()),
        vocab_size=TINY_VOCAB,
        workdir=Path(workdir),
        atol=1e-5,
        load_adapter=_load_adapter,
    )


def train_step(
    engine: FSDPEngine, batch: TensorDict, loss_fn: LossFn | None = None
) -> tuple[float, float]:
    """One forward_backward + optimizer_step on this rank's share of `batch` (contiguous
    equal chunks, like the kit); returns (loss, grad norm)."""
    n = batch.batch_size[0] // engine.dp_size
    share = B.trim_padding(batch[engine.dp_rank * n : (engine.dp_rank + 1) * n])
    with engine.train_mode():
        metrics = engine.forward_backward(share, loss_fn or nll_loss_fn)
        grad_norm = engine.optimizer_step()
        engine.lr_scheduler_step()
    return metrics["loss"], grad_norm


def full_gradients(engine: FSDPEngine) -> list[torch.Tensor]:
    """Every parameter's accumulated gradient, unsharded (zeros where none)."""
    out = []
    for p in engine.scorer.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out.append((g.full_tensor() if isinstance(g, DTensor) else g).detach().clone())
    return out


def share_gradients(
    shares: list[TensorDict], loss_fn: LossFn, overrides: dict[str, Any] | None = None
) -> list[torch.Tensor]:
    """Rank body (`run_distributed`): one `forward_backward` of `loss_fn` on this rank's
    batch, `shares[dp_rank]`, on a tiny engine (`tiny_engine_config(**overrides)`); returns
    `full_gradients`."""
    engine = FSDPEngine.build(tiny_engine_config(**(overrides or {})))
    with engine.train_mode():
        engine.forward_backward(B.trim_padding(shares[engine.dp_rank]), loss_fn)
    return full_gradients(engine)


def grouped_batch(groups: int = 3, n: int = 4, seed: int = 0) -> TensorDict:
    """A GRPO-shaped batch: `groups` random prompts (left-padded, 2-7 tokens) with `n`
    sampled responses each (right-padded, 1-7 tokens), rows grouped by prompt."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(1, TINY_VOCAB, (int(length),), generator=g)
        for length in torch.randint(2, 8, (groups,), generator=g)
    ]
    rows = [
        (
            p,
            torch.randint(
                1, TINY_VOCAB, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g
            ),
        )
        for p in prompts
        for _ in range(n)
    ]
    return padded_batch(rows)


def padded_batch(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> TensorDict:
    """A batch of (prompt ids, response ids) rows: prompts left-padded, responses
    right-padded, the response mask on the response tokens."""
    width_p, width_r = max(len(p) for p, _ in rows), max(len(r) for _, r in rows)
    ids = torch.zeros(len(rows), width_p + width_r, dtype=torch.int64)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        ids[i, width_p - len(p) : width_p + len(r)] = torch.cat([p, r])
        attn[i, width_p - len(p) : width_p + len(r)] = 1
        resp[i, width_p : width_p + len(r)] = 1
    return B.make_batch(ids, attn, resp)


def distributed_conformance(workdir: str) -> dict[str, Any]:
    """Rank body of the multi-process test (run through `run_distributed`): the whole kit,
    then two training steps (fully sharded, and replicated with `parallel.fsdp_size=1`, and
    on `grouped_batch` with shared prefixes) whose loss and grad norm the test compares
    with a single-process run."""
    passed = run_conformance(conformance_spec(Path(workdir)))
    batch = random_batch(TINY_VOCAB, num_sequences=8, seed=5)
    steps = {}
    for label, overrides in {"sharded": {}, "replicated": {"parallel.fsdp_size": 1}}.items():
        engine = FSDPEngine.build(tiny_engine_config(**overrides))
        steps[label] = [train_step(engine, batch), train_step(engine, batch)]
    # shared prompt prefixes under FSDP: each sharded layer runs twice per micro-batch
    engine = FSDPEngine.build(tiny_engine_config(**{"micro_batch.share_prefix": True}))
    grouped = grouped_batch()
    shared = [train_step(engine, grouped), train_step(engine, grouped)]
    return {"passed": passed, "steps": steps, "shared_prefix": shared}


ULYSSES = {"parallel.context": 2, "micro_batch.use_packing": True}
"""Overrides for Ulysses sequence parallelism over 2 ranks."""


def ulysses_outputs(engine: FSDPEngine, batch: TensorDict, steps: int = 2) -> dict[str, Any]:
    """Log-probs `[B, T]` of `batch` before training, then `steps` training steps
    (loss, grad norm) on this rank's share: what the SP=2 vs SP=1 parity test compares."""
    with engine.eval_mode():
        log_probs = engine.forward(batch)["log_probs"]
    return {"log_probs": log_probs, "steps": [train_step(engine, batch) for _ in range(steps)]}


def distributed_ulysses(workdir: str) -> dict[str | int, Any]:
    """Rank body of the Ulysses test (2 ranks, `parallel.context=2`, so one sequence group):
    the conformance kit, then `ulysses_outputs` on a packed batch of unequal lengths for
    the tiny GQA model (4 query, 2 key/value heads) and for 1 key/value head (fewer than
    the 2 ranks: replicated), and for the first with gradient checkpointing and with LoRA (rank 4)."""
    passed = run_conformance(conformance_spec(Path(workdir), **ULYSSES))
    batch = random_batch(TINY_VOCAB, num_sequences=6, response_lengths=(1, 12), seed=11)
    out: dict[str | int, Any] = {"passed": passed}  # the outputs by key/value head count
    for kv in (2, 1):
        cfg = tiny_engine_config(**ULYSSES)
        cfg.model.hf_config = tiny_qwen2_config(num_key_value_heads=kv)
        out[kv] = ulysses_outputs(FSDPEngine.build(cfg), batch)
    # gradient checkpointing re-runs the all-to-alls in the backward
    out["checkpointed"] = ulysses_outputs(
        FSDPEngine.build(tiny_engine_config(**ULYSSES, **{"model.gradient_checkpointing": True})),
        batch,
    )
    out["lora"] = ulysses_outputs(
        FSDPEngine.build(tiny_engine_config(**ULYSSES, **{"lora.rank": 4})), batch
    )
    return out


def value_loss_fn(outputs: TensorDict, batch: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
    """A critic's test loss: token-mean squared distance of the response tokens' values to
    1, as a contribution to the global loss: sum((v - 1)^2 * mask) / global_token_count."""
    mask = batch[B.RESPONSE_MASK].to(outputs["values"].dtype)
    loss = ((outputs["values"] - 1.0) ** 2 * mask).sum() / batch[B.GLOBAL_TOKEN_COUNT][0]
    return loss, {"value_contribution": Share(float(loss.detach()))}


def vision_steps(
    vlm_path: str, batch: Any, overrides: dict[str, Any] | None = None, steps: int = 2
) -> dict[str, Any]:
    """`steps` training steps of an fsdp engine on the tiny vision-language model at
    `vlm_path` (any family in `VISION_FAMILIES`) with `batch` (a batch with images; each rank
    on its share), then the log-probs (a critic, `model.role=value`: the values) of the whole
    batch and every exported weight, the vision tower's under `tower`: what the 2-rank vs
    1-rank parity test compares."""
    cfg = apply_overrides(
        EngineConfig(
            model=ModelConfig(path=vlm_path),
            device="cpu",
            optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0),
        ),
        overrides or {},
    )
    engine = FSDPEngine.build(cfg)
    critic = cfg.model.role == "value"
    loss_fn = value_loss_fn if critic else nll_loss_fn
    out: dict[str, Any] = {"steps": [train_step(engine, batch, loss_fn) for _ in range(steps)]}
    tower = vision_family(engine.hf_model.config).tower_modules
    with engine.eval_mode():
        out["outputs"] = engine.forward(batch)["values" if critic else "log_probs"]
        weights = {name: t.clone() for bucket in engine.export_weights() for name, t in bucket}
    out["tower"] = {n: t for n, t in weights.items() if any(f"{m}." in n for m in tower)}
    out["weights"] = weights
    return out


def vision_jobs(jobs: list[tuple[str, Any, dict[str, Any]]]) -> list[dict[str, Any]]:
    """`vision_steps(path, batch, overrides)` of each job in turn, in one process (so one
    multi-process start covers several models and options)."""
    return [vision_steps(path, batch, overrides) for path, batch, overrides in jobs]
