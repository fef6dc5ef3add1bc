"""Test helpers: tiny HF configs, the single-process transformers reference, and the
conformance spec of this backend (used by this package's tests and by cross-backend tests)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file
from tensordict import TensorDict
from transformers import PreTrainedModel

from tephra.core.config import from_dict
from tephra.engine_api import batch as B
from tephra.engine_api import get_engine
from tephra.engine_api.config import EngineConfig, apply_overrides
from tephra.engine_api.engine import Engine
from tephra.engine_api.testing import (
    CHECKS,
    ConformanceSpec,
    ReferenceModel,
    nll_loss_fn,
    random_batch,
    run_conformance,
)
from tephra.engine_megatron import hf_conversion as conv
from tephra.engine_megatron.hf_conversion import checkpoint_format
from tephra.engine_megatron.hf_loading import reference_model

if TYPE_CHECKING:
    from peft import PeftModel

    from tephra.engine_megatron.engine import MegatronEngine

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

_TINY_COMMON: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rope_theta=1e6,  # not the default: a model that ignored it would differ
)
TINY_QWEN3: dict[str, Any] = dict(model_type="qwen3", **_TINY_COMMON)
"""A tiny Qwen3: RMSNorm on each query and key head, no qkv bias."""
TINY_MISTRAL: dict[str, Any] = dict(model_type="mistral", sliding_window=64, **_TINY_COMMON)
"""A tiny Mistral (Llama-like, no bias) with a 64-token sliding window."""
TINY_QWEN3_MOE: dict[str, Any] = dict(
    model_type="qwen3_moe",
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    **_TINY_COMMON,
)
"""A tiny Qwen3-MoE: q/k norm, 4 experts, top-2 with renormalised weights, no shared expert."""
TINY_MOE_DENSE_FIRST: dict[str, Any] = {**TINY_MOE, "mlp_only_layers": [0]}
"""A DeepSeek-style layout on Qwen2-MoE: the first layer a dense MLP, then routed experts
beside a gated shared expert."""
TINY_QWEN3_MOE_STEP2: dict[str, Any] = {
    **TINY_QWEN3_MOE,
    "num_hidden_layers": 4,
    "decoder_sparse_step": 2,
}
"""Qwen3-MoE with every second layer sparse (layers 1 and 3; 0 and 2 dense)."""
TINY_GEMMA3: dict[str, Any] = dict(
    model_type="gemma3_text",
    vocab_size=128,
    hidden_size=48,  # sqrt(48) is not exact: the embedding scale's rounding is tested
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,  # not head_dim: a model that scaled by head_dim would differ
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=64,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    },
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
"""A tiny Gemma-3 (text): a sliding (64-token window, RoPE base 1e4) and a full-attention
layer (base 1e6), (1 + weight) sandwich norms, q/k norm, GeGLU, embeddings times
sqrt(hidden), tied output layer, scores scaled by query_pre_attn_scalar^-0.5."""
TINY_LLAMA31: dict[str, Any] = dict(
    model_type="llama",
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    **{k: v for k, v in _TINY_COMMON.items() if k != "rope_theta"},
)
"""A tiny Llama-3.1: its llama3 RoPE scaling with a 16-token original context, so that the
frequency bands it rescales turn within the tests' 40-60 token sequences."""
TINY_QWEN2_YARN: dict[str, Any] = dict(
    model_type="qwen2",
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    **{k: v for k, v in _TINY_COMMON.items() if k not in ("rope_theta", "max_position_embeddings")},
    max_position_embeddings=64,
)
"""A tiny Qwen2 with YaRN (factor 4 over a 16-token original context): its ramp between the
interpolated and extrapolated bands and its attention factor 0.1 ln(4) + 1."""
TINY_DEEPSEEK_V3: dict[str, Any] = dict(
    model_type="deepseek_v3",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    rope_interleave=True,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
"""A tiny DeepSeek-V3: multi-head latent attention (q and kv latents 32 and 16 wide, 16 + 8
query/key head dims, value heads of 12) with YaRN over a 16-token original context (an
attention factor mscale(4, 1) / mscale(4, 0.8) on the RoPE parts, the softmax scale times
mscale(4, 0.8)^2), a dense first layer, then 8 routed experts in 4 groups (top-4 within the best 2
groups, sigmoid scores plus the correction bias) beside one shared expert."""
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3": TINY_GEMMA3,
    "qwen3": TINY_QWEN3,
    "mistral": TINY_MISTRAL,
    "qwen3_moe": TINY_QWEN3_MOE,
    "qwen2_moe_dense_first": TINY_MOE_DENSE_FIRST,
    "qwen3_moe_step2": TINY_QWEN3_MOE_STEP2,
    "deepseek_v3": TINY_DEEPSEEK_V3,
}


def base_config(
    hf_config: dict[str, Any], parallel: dict[str, Any] | None = None, **sections: Any
) -> EngineConfig:
    """fp32, lr 1e-2 (one step visibly lowers the loss), no clipping surprises."""
    return from_dict(
        EngineConfig,
        {
            "model": {"hf_config": dict(hf_config), "init_seed": 0},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.0, "grad_clip": 1.0},
            "micro_batch": {"max_tokens_per_microbatch": 4096},
            "parallel": parallel or {},
            **sections,
        },
    )


class HFReference:
    """Plain transformers model (single process, eager attention) with the engine's initial
    weights; implements the conformance kit's `ReferenceModel`."""

    def __init__(self, hf_config: dict[str, Any], init_seed: int = 0) -> None:
        data = dict(hf_config)
        cfg = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
        self.model: PreTrainedModel | PeftModel = reference_model(cfg, init_seed)
        self.model.eval()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = dict(weights)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = self.model.config.tie_word_embeddings
        missing = [m for m in missing if not (tied and m == "lm_head.weight")]
        assert not missing and not unexpected, f"missing {missing}, unexpected {unexpected}"

    def load_adapter(self, folder: Path) -> None:
        """Wrap the model in the peft adapter `MegatronEngine.export_adapter` wrote."""
        # imported here: peft takes seconds to import and only LoRA checks need it
        from peft import PeftModel

        self.model = PeftModel.from_pretrained(self.model, str(folder)).eval()

    def logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        with torch.no_grad():
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
            ).logits.float()


def _load_adapter(ref: ReferenceModel, folder: Path) -> None:
    """The kit's `load_adapter` for the `HFReference` that `conformance_spec` makes."""
    if not isinstance(ref, HFReference):
        raise TypeError(f"load_adapter expects an HFReference, got {type(ref).__name__}")
    ref.load_adapter(folder)


def conformance_spec(
    hf_config: dict[str, Any], parallel: dict[str, Any], workdir: Path, dispatcher: str = "alltoall"
) -> ConformanceSpec:
    # deferred: importing the engine applies cpu_compat's torch.cuda patches; only ranks should
    from tephra.engine_megatron.engine import MegatronEngine

    # the kit's LoRA checks ask for lora.rank > 0 alone: on an MoE model engine-megatron
    # adapts the attention linears only, so the base config names them
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora = {"target_modules": attention} if hf_config.get("num_experts") else {}
    base = base_config(hf_config, {**parallel, "moe_token_dispatcher": dispatcher}, lora=lora)
    return ConformanceSpec(
        make_engine=lambda overrides: MegatronEngine.build(apply_overrides(base, overrides)),
        make_reference=lambda: HFReference(hf_config),
        vocab_size=hf_config["vocab_size"],
        workdir=Path(workdir),
        atol=1e-5,
        load_adapter=_load_adapter,
    )


# ----- functions run on every rank by `run_distributed` (must be importable) --------------
KIT_CHECKS = [name for name in CHECKS if name != "adapter_weights_load"]
"""The conformance checks engine=megatron passes: all but `adapter_weights_load`
(`load_adapter_weights()` is refused, see the README)."""


LORA_CHECKS = ("reference_mode_is_base_model", "adapter_export_matches")


def kit_checks(hf_config: dict[str, Any]) -> list[str]:
    """The kit checks a model passes: `KIT_CHECKS`, less the LoRA ones on DeepSeek-V3 (LoRA
    is refused there)."""
    if hf_config["model_type"] == "deepseek_v3":
        return [c for c in KIT_CHECKS if c not in LORA_CHECKS]
    return KIT_CHECKS


def rank_conformance(
    hf_config: dict[str, Any],
    parallel: dict[str, Any],
    workdir: str,
    dispatcher: str = "alltoall",
    checks: list[str] | None = None,
) -> list[str]:
    """Run the conformance kit on this rank (`kit_checks(hf_config)` by default); returns the
    names of the checks that passed."""
    spec = conformance_spec(hf_config, parallel, Path(workdir), dispatcher)
    return run_conformance(spec, kit_checks(hf_config) if checks is None else checks)


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
        **FAMILIES,
    }
    return [
        rank_conformance(models[m], parallel, str(Path(workdir) / f"run{i}"), disp, checks)
        for i, (m, parallel, disp, checks) in enumerate(runs)
    ]


def rank_first_step(
    model_path: str, parallel: dict[str, Any], batch: TensorDict, export_to: str | None
) -> tuple[float, float, dict[str, torch.Tensor]]:
    """Build through the registry from an HF folder, take one step on `batch` (every rank
    gets the same batch: pure model parallelism), optionally export_hf; returns
    (loss, grad norm, forward outputs before the step)."""
    config = from_dict(
        EngineConfig,
        {
            "model": {"path": model_path},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.0, "grad_clip": 1.0},
            "parallel": parallel,
        },
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
    batch: TensorDict,
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
    # deferred: importing the engine applies cpu_compat's torch.cuda patches; only ranks should
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

    def step(engine: Engine) -> tuple[float, float]:
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


def gathered_hf_weights(engine: MegatronEngine) -> dict[str, torch.Tensor]:
    """The export as it was before streaming, kept as the tests' reference: every rank
    completes its weights over TP, then `all_gather_object` hands the whole model to every
    rank (peak host memory: the model, pickled, on every rank)."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core, in the ranks only

    owned: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, int], torch.Tensor] = {}
    keep_local = (
        ps.get_data_parallel_rank(with_context_parallel=True) == 0
        and ps.get_tensor_model_parallel_rank() == 0
    )
    keep_expert = (
        ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    )
    with torch.no_grad():
        for chunk in engine.chunks:
            offsets = engine._layer_offsets(chunk)
            for name, param in chunk.hf_weights():
                if ".lora." in name:
                    continue  # the reference export is of the base weights
                m = conv.match(name, offsets, engine.shape.model_type)
                _, size, group = engine._shard_coords(m)
                if m.kind == "rep" or size == 1:
                    shards = [param.detach()]
                else:
                    shards = [torch.empty_like(param) for _ in range(size)]
                    dist.all_gather(shards, param.detach().contiguous(), group=group)
                pieces = conv.from_megatron(m, [s.clone() for s in shards], engine._heads)
                if m.is_expert:
                    if keep_expert:
                        expert = engine._global_expert(m)
                        assert expert is not None  # an expert weight has its index
                        for hf_name, t in pieces.items():
                            experts[(hf_name, expert)] = t
                elif keep_local:
                    owned.update(pieces)
    everything: list = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (owned, experts))
    full: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for rank_owned, rank_experts in everything:
        full.update(rank_owned)
        for (hf_name, e), t in rank_experts.items():
            stacked.setdefault(hf_name, {})[e] = t
    for hf_name, by_expert in stacked.items():
        full[hf_name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    if engine.shape.tie_word_embeddings and engine.config.model.role == "policy":
        full.pop("lm_head.weight", None)
    return full


def rank_streamed_export(runs: list[tuple[str, dict[str, Any]]], workdir: str) -> list[dict]:
    """For each (model, parallel) run: build, take one AdamW step (the weights then differ
    from the HF init on every shard), then compare the streamed `export_weights` (tiny
    buckets, with and without the untied head) and `export_hf` against
    `gathered_hf_weights`. Returns per run: whether every rank's export equals it bitwise,
    the bucket count, and (rank 0) whether the written safetensors equal it bitwise."""
    # deferred: importing the engine applies cpu_compat's torch.cuda patches; only ranks should
    from tephra.engine_megatron.engine import MegatronEngine

    models = {
        "dense": TINY_DENSE,
        "moe": TINY_MOE,
        "dense_tied": {**TINY_DENSE, "tie_word_embeddings": True},
    }
    out = []
    for i, (model, parallel) in enumerate(runs):
        cfg = models[model]
        engine = MegatronEngine.build(base_config(cfg, parallel))
        batch = random_batch(cfg["vocab_size"], num_sequences=4, seed=i)
        with engine.train_mode():
            engine.forward_backward(batch, nll_loss_fn)
            engine.optimizer_step()
        want = gathered_hf_weights(engine)
        buckets = list(engine.export_weights(bucket_bytes=20_000))
        got = [pair for bucket in buckets for pair in bucket]
        names = [n for n, _ in got]
        streamed = dict(got)
        untied = dict(w for b in engine.export_weights(untie_word_embeddings=True) for w in b)
        folder = Path(workdir) / f"run{i}"
        engine.export_hf(folder)
        result = {
            "unique_names": len(names) == len(set(names)),
            "export_equal": streamed.keys() == want.keys()
            and all(torch.equal(streamed[k].cpu(), want[k].cpu()) for k in want),
            # tied: the head is yielded only when asked for, as the embedding
            "untied_head": torch.equal(untied["lm_head.weight"], want["model.embed_tokens.weight"])
            if engine.shape.tie_word_embeddings
            else untied.keys() == want.keys(),
            "buckets": len(buckets),
        }
        if torch.distributed.get_rank() == 0:
            written = load_file(folder / "model.safetensors")
            want = checkpoint_format(want)  # experts one by one, as checkpoints store them
            result["hf_equal"] = written.keys() == want.keys() and all(
                torch.equal(written[k], want[k].cpu()) for k in want
            )
        out.append(result)
    return out


def rank_step(
    hf_config: dict[str, Any],
    parallel: dict[str, Any],
    batch: TensorDict,
    overrides: dict[str, Any] | None = None,
) -> tuple[float, float, torch.Tensor]:
    """Forward log-probs, then one step's loss and grad norm, of an engine built from
    `hf_config` with `parallel` (every rank gets the same batch)."""
    # deferred: importing the engine applies cpu_compat's torch.cuda patches; only ranks should
    from tephra.engine_megatron.engine import MegatronEngine

    engine = MegatronEngine.build(
        apply_overrides(base_config(hf_config, parallel), overrides or {})
    )
    log_probs = engine.forward(batch)["log_probs"]
    with engine.train_mode():
        loss = engine.forward_backward(batch, nll_loss_fn)["loss"]
        norm = engine.optimizer_step()
    return loss, norm, log_probs


def rank_replayed_log_probs(
    model_path: str, parallel: dict[str, Any], batch: TensorDict
) -> tuple[Any, float]:
    """Log-probs of `batch` (carrying `routed_experts`) under routing replay, and the loss of
    one step on it, at the `parallel` layout (every rank the same batch)."""
    # deferred: importing the engine applies cpu_compat's torch.cuda patches; only ranks should
    from tephra.engine_megatron.engine import MegatronEngine

    engine = MegatronEngine.build(
        from_dict(
            EngineConfig,
            {
                "model": {"path": model_path},
                "parallel": parallel,
                "moe": {"routing_replay": "rollout"},
            },
        )
    )
    log_probs = engine.forward(batch)["log_probs"]
    with engine.train_mode():
        loss = engine.forward_backward(batch, nll_loss_fn)["loss"]
    return log_probs.numpy(), loss


def rank_gradients(
    hf_config: dict[str, Any], parallel: dict[str, Any], batch: TensorDict
) -> dict[str, Any]:
    """The full gradient of one `nll_loss_fn` step on `batch` (every rank the same batch), in
    HF names, read back from the weights' change: with lr 1, no weight decay or clipping and
    Adam's eps = 100, the first AdamW step moves each weight by u = g / (|g| + eps), so
    g = u * eps / (1 - |u|) (exact, and |u| < 1e-2 keeps float32's rounding of the weight
    well under the tolerance). Numpy arrays (they pickle by value)."""
    # deferred: importing the engine applies cpu_compat's torch.cuda patches; only ranks should
    from tephra.engine_megatron.engine import MegatronEngine

    eps = 100.0
    config = apply_overrides(
        base_config(hf_config, parallel),
        {"optimizer.lr": 1.0, "optimizer.eps": eps, "optimizer.grad_clip": 1e9},
    )
    engine = MegatronEngine.build(config)
    before = engine.hf_weights()
    with engine.train_mode():
        engine.forward_backward(batch, nll_loss_fn)
        engine.optimizer_step()
    after = engine.hf_weights()
    out = {}
    for name, w in before.items():
        u = (w.double() - after[name].double()).numpy()
        out[name] = u * eps / (1.0 - abs(u))
    return out


def reference_gradients(hf_config: dict[str, Any], batch: TensorDict) -> dict[str, Any]:
    """Plain autograd on the transformers model (the engine's initial weights) of the same
    token-mean NLL over the response tokens: {HF name: gradient} (numpy; parameters only)."""
    model = HFReference(hf_config).model
    model.train()
    ids, mask = batch[B.INPUT_IDS], batch[B.RESPONSE_MASK].float()
    logits = model(
        input_ids=ids,
        attention_mask=batch[B.ATTENTION_MASK],
        position_ids=batch[B.POSITION_IDS],
    ).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
    loss.backward()
    return {n: p.grad.double().numpy() for n, p in model.named_parameters() if p.grad is not None}
