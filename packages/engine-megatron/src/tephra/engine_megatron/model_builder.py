"""Build megatron `GPTModel` chunks (policy or value) from a Hugging Face config.

Layer spec: megatron's local (TransformerEngine-free) spec, with two substitutions:
- `SegmentAttention` (per-sequence blocks from an attention plan, no dense mask; torch,
  flash-attn or TransformerEngine kernel; context parallel) in place of `DotProductAttention`;
- `RMSNorm` below in place of torch's norm, which refuses sequence parallelism: with
  sequence parallel its weight sees only this rank's tokens, so it is tagged
  `sequence_parallel=True` and its gradient is summed over the TP group by the engine.
Gemma-3 adds `GemmaRMSNorm` (x * (1 + weight)) everywhere, its sandwich norms as
`PostNormAdd` in the bias-dropout-add slots (the residual adds the normalised output),
embeddings scaled by sqrt(hidden) and one RoPE base per layer type (a pre-hook on each
layer's attention picks its layer's angles). DeepSeek-V3 takes megatron's MLA spec with the
down projections replicated (`ReplicatedLinear`), its rotary embedding answered with the
batch's angles (`MLARope`), and the sigmoid router with its correction bias.
RoPE inverse frequencies (default, linear, llama3, yarn) are transformers' own
(`rope_frequencies`).

`TephraGPT` wraps one pipeline chunk. On the last stage it returns per-position outputs
instead of logits: policy `[b, s, 2]` = (log p(label), entropy) from the vocab-parallel
kernel; value `[b, s, 1]` from a linear head on the final hidden state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tephra.engine_api.config import ParallelConfig
from tephra.engine_api.errors import ConfigError
from tephra.engine_megatron.core_attention import SegmentAttention
from tephra.kernels import vocab_parallel_logprob_entropy

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma3_text",
    "deepseek_v3",
)
_MLA = ("deepseek_v3",)
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text")
_GEMMA = ("gemma3_text",)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""`rope_parameters.rope_type` values engine-megatron computes as transformers does (Gemma-3:
default and linear per layer type)."""
_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (computed in float32, as Hugging Face does)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        # Each TP rank normalises only its own tokens under sequence parallelism. (megatron
        # tags parameters with attributes it reads; torch's Parameter declares none)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm: the weight is stored as an offset from 1, y = (x_n * (1 + weight)) cast
    back to the input dtype (Llama casts x_n first, Gemma after the product)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class PostNormAdd(GemmaRMSNorm):
    """Gemma's post-attention / post-feed-forward norm in megatron's bias-dropout-add slot:
    called like megatron's `get_bias_dropout_add(training, fused)`, it returns
    `f((out, bias), residual, dropout) = residual + norm(out)` (no bias, dropout 0)."""

    def forward(  # type: ignore[override]
        self, training: bool, fused: bool
    ) -> Callable[[tuple[torch.Tensor, torch.Tensor | None], torch.Tensor, float], torch.Tensor]:
        def add(
            out_with_bias: tuple[torch.Tensor, torch.Tensor | None],
            residual: torch.Tensor,
            prob: float,
        ) -> torch.Tensor:
            out, bias = out_with_bias
            assert bias is None and (prob == 0.0 or not training), "Gemma runs without either"
            return residual + GemmaRMSNorm.forward(self, out)

        return add


@dataclass
class ModelShape:
    """What the engine needs to know of the HF architecture."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    num_experts: int
    qkv_bias: bool
    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3)."""
    sliding_window: int | None = None
    """Mistral's (or Gemma-3's sliding layers') attention window: sequences up to this
    length see every earlier token (longer ones are refused)."""
    gemma: bool = False
    """Gemma-3 layout: (1 + weight) norms, sandwich norms around attention and MLP,
    embeddings times sqrt(hidden_size), GeGLU."""
    layer_ropes: tuple[tuple[float, float], ...] = ()
    """(RoPE base, linear scaling factor) of each layer (Gemma-3: one per layer type); empty =
    `rope_theta`, unscaled, for all."""
    activation: str = "silu"
    """The gated MLP's activation (silu: SwiGLU; gelu_pytorch_tanh: Gemma's GeGLU)."""
    mla: bool = False
    """DeepSeek-V3's multi-head latent attention (low-rank q and kv projections, a shared
    RoPE key part); `head_dim` is then the value head's size."""


def rope_theta(hf_config: PretrainedConfig) -> float:
    """RoPE base: transformers 5 keeps it in `rope_parameters`, older configs in `rope_theta`."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)


def model_shape(hf_config: PretrainedConfig) -> ModelShape:
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported by engine-megatron; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)} (use engine=fsdp for other architectures)"
        )
    rope_parameters(hf_config)  # an unsupported RoPE is refused before any rank starts
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    mla = model_type in _MLA
    if mla:
        _mla_refusals(hf_config)
        head_dim = hf_config.v_head_dim
    experts = hf_config.n_routed_experts if mla else getattr(hf_config, "num_experts", 0)
    return ModelShape(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        num_experts=int(experts or 0),
        qkv_bias=model_type in ("qwen2", "qwen2_moe")
        or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=model_type in _QK_NORM,
        sliding_window=_sliding_window(hf_config),
        gemma=model_type in _GEMMA,
        layer_ropes=_layer_ropes(hf_config),
        activation=_activation(hf_config),
        mla=mla,
    )


def _mla_refusals(hf_config: PretrainedConfig) -> None:
    """DeepSeek-V3 settings megatron's MLA and router cannot express, each named."""

    def refuse(setting: str, why: str) -> None:
        raise ConfigError(
            f"{setting} is not supported by engine-megatron for deepseek_v3 ({why}); "
            "use engine=fsdp"
        )

    if getattr(hf_config, "attention_bias", False):
        refuse("attention_bias=true", "megatron's MLA projections have no bias")
    if not getattr(hf_config, "rope_interleave", True):
        refuse("rope_interleave=false", "megatron's MLA rotates interleaved pairs only")
    topk, groups = hf_config.num_experts_per_tok, int(hf_config.n_group or 1)
    if topk > 1 and not hf_config.norm_topk_prob:
        refuse("norm_topk_prob=false", "megatron renormalises sigmoid top-k weights")
    if groups > 1 and topk // int(hf_config.topk_group) != 2:
        refuse(
            f"num_experts_per_tok={topk} with topk_group={hf_config.topk_group}",
            "megatron scores a group by its top num_experts_per_tok // topk_group experts, "
            "transformers by its top 2: their ratio must be 2",
        )


def _activation(hf_config: PretrainedConfig) -> str:
    gemma = hf_config.model_type in _GEMMA
    field = "hidden_activation" if gemma else "hidden_act"
    act = getattr(hf_config, field, "silu")
    want = "gelu_pytorch_tanh" if gemma else "silu"
    if act != want:
        raise ConfigError(
            f"{field}={act!r}: engine-megatron supports only {want} for "
            f"{hf_config.model_type}; use engine=fsdp"
        )
    return act


def _gemma_refusals(hf_config: PretrainedConfig) -> None:
    """Gemma-3 settings this engine cannot express, each named."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(hf_config, name, None) is not None:
            raise ConfigError(
                f"{name}={getattr(hf_config, name)} is not supported by engine-megatron "
                f"(no tanh soft-capping in its kernels); set {name}=null or use engine=fsdp"
            )
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ConfigError(
            "use_bidirectional_attention=true is not supported by engine-megatron (causal "
            "attention only); use engine=fsdp"
        )
    for layer_type, params in (getattr(hf_config, "rope_parameters", None) or {}).items():
        if params.get("rope_type", "default") not in ("default", "linear"):
            raise ConfigError(
                f"rope_parameters[{layer_type!r}].rope_type={params['rope_type']!r} is not "
                "supported by engine-megatron (default and linear RoPE only); use engine=fsdp"
            )


def _layer_ropes(hf_config: PretrainedConfig) -> tuple[tuple[float, float], ...]:
    """(base, linear scaling factor) of each layer's RoPE (Gemma-3's larger checkpoints
    divide the frequencies of their full-attention layers by a factor)."""
    if hf_config.model_type not in _GEMMA:
        return ()
    _gemma_refusals(hf_config)
    params = hf_config.rope_parameters
    return tuple(
        (
            float(params[t]["rope_theta"]),
            float(params[t]["factor"]) if params[t].get("rope_type") == "linear" else 1.0,
        )
        for t in hf_config.layer_types
    )


def rope_parameters(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The model's (single) RoPE parameters, its `rope_type` checked against `ROPE_TYPES`
    (Gemma-3's per-layer-type parameters are `_layer_ropes`' job: empty here)."""
    if hf_config.model_type in _GEMMA:
        return {}
    params = dict(
        getattr(hf_config, "rope_parameters", None)
        or getattr(hf_config, "rope_scaling", None)
        or {}
    )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"rope_parameters.rope_type={kind!r} ({hf_config.model_type}) is not supported by "
            f"engine-megatron; supported: {list(ROPE_TYPES)} (use engine=fsdp for {kind!r} RoPE)"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(
            f"rope_parameters.partial_rotary_factor={params['partial_rotary_factor']} is not "
            "supported by engine-megatron (RoPE on the whole head only); use engine=fsdp"
        )
    return params


def rope_frequencies(hf_config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies `[rope_dim / 2]`, attention factor) of a model with one RoPE, as
    transformers computes them (`ROPE_INIT_FUNCTIONS` for linear, Llama-3.1's llama3 and YaRN:
    their low/high frequency bands, `original_max_position_embeddings`, YaRN's `mscale`),
    so that megatron's rotary embedding rotates by the same angles."""
    params = rope_parameters(hf_config)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        inv, factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
        return inv.float(), float(factor)
    dim = rope_head_dim(hf_config)
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    return 1.0 / (rope_theta(hf_config) ** exponents), 1.0


def rope_head_dim(hf_config: PretrainedConfig) -> int:
    """The rotated part of a head: all of it, except MLA's `qk_rope_head_dim`."""
    if getattr(hf_config, "qk_rope_head_dim", None):
        return int(hf_config.qk_rope_head_dim)
    heads = hf_config.num_attention_heads
    return int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)


def _sliding_window(hf_config: PretrainedConfig) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if hf_config.model_type == "mistral":
        return window
    if hf_config.model_type in _GEMMA:
        return window if "sliding_attention" in hf_config.layer_types else None
    if getattr(hf_config, "use_sliding_window", False) and window is not None:
        raise ConfigError(
            f"{hf_config.model_type} with use_sliding_window=true is not supported by "
            "engine-megatron (windowed layers); use engine=fsdp"
        )
    return None


def transformer_config(
    hf_config: PretrainedConfig,
    parallel: ParallelConfig,
    params_dtype: torch.dtype,
    moe_dispatcher: str,
    gradient_checkpointing: bool = False,
) -> TransformerConfig:
    """megatron TransformerConfig equal in function to the HF config (dropout off: RL
    fine-tuning of these models runs without it, and the contract compares exactly)."""
    shape = model_shape(hf_config)
    _, attention_factor = rope_frequencies(hf_config)
    # transformers multiplies cos and sin by YaRN's attention factor: every score q.k, with
    # the whole head rotated, by its square, which the softmax scale carries here
    scale = float(hf_config.query_pre_attn_scalar) ** -0.5 if shape.gemma else None
    if attention_factor != 1.0 and not shape.mla:
        scale = shape.head_dim**-0.5 * attention_factor**2
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=_ACTIVATIONS[shape.activation],
        # Gemma scales scores by query_pre_attn_scalar^-0.5, the others by head_dim^-0.5
        # (times YaRN's attention factor squared)
        softmax_scale=scale,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=(
            parallel.virtual_pipeline if parallel.virtual_pipeline > 1 else None
        ),
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.expert_tensor,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights come from the HF model
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # the loss function already divides by the global normalisers
        calculate_per_token_loss=True,
        # pipeline stages exchange one fixed shape per step (micro-batches are padded to it)
        variable_seq_lengths=False,
        # gloo may deliver two sends to one peer swapped inside a batched p2p
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=False,
        # megatron's default (allgather) refuses variable sequence lengths even for dense models
        moe_token_dispatcher_type="alltoall",
    )
    if gradient_checkpointing:
        # recompute every layer in backward (megatron's full, uniform recomputation)
        kwargs.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    if shape.mla:
        kwargs.update(_mla_kwargs(hf_config))
    if shape.num_experts:
        if moe_dispatcher == "allgather" and parallel.pipeline > 1:
            raise ConfigError(
                "the allgather MoE dispatcher cannot run with parallel.pipeline > 1 "
                "(megatron needs fixed shapes for it); use the alltoall dispatcher"
            )
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
        kwargs.update(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_router_topk=hf_config.num_experts_per_tok,
            # HF: softmax over all experts, then top-k; renormalised only with norm_topk_prob
            moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", False),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type=moe_dispatcher,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            moe_permute_fusion=False,
        )
        if shared:
            kwargs.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
        if shape.mla:
            kwargs.update(_deepseek_router_kwargs(hf_config))
        pattern = sparse_layers(hf_config)
        if not all(pattern):  # dense MLP layers among the MoE ones (e.g. the first k dense)
            kwargs.update(moe_layer_freq=[int(p) for p in pattern])
    if shape.mla:
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def _mla_kwargs(hf_config: PretrainedConfig) -> dict[str, Any]:
    """megatron's MLA fields from DeepSeek-V3's. The softmax scale megatron derives,
    mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(q head dim), equals transformers'
    `yarn_apply_mscale` when the factor is RoPE's `factor` for any scaled RoPE (1 unscaled)
    and `mscale_all_dim` is the config's (0: no change). The RoPE angles and YaRN's attention
    factor on cos/sin come from the batch (`MLARope`), not from megatron's own rotary."""
    params = rope_parameters(hf_config)
    scaled = params.get("rope_type", "default") != "default"
    return dict(
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        kv_channels=hf_config.v_head_dim,
        # "yarn": megatron's MLA then takes (angles, attention factor) from its rotary
        rope_type="yarn",
        rotary_base=rope_theta(hf_config),
        rotary_scaling_factor=float(params["factor"]) if scaled else 1.0,
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0) if scaled else 0.0,
        # transformers' q_a_layernorm / kv_a_layernorm: the spec's q/k norm slots
        qk_layernorm=True,
    )


def _deepseek_router_kwargs(hf_config: PretrainedConfig) -> dict[str, Any]:
    """DeepSeek-V3's router: sigmoid scores, top-k chosen on score + e_score_correction_bias
    within the best `topk_group` of `n_group` groups, weights = the chosen scores
    renormalised, times `routed_scaling_factor`; a shared expert without gate; the first
    `first_k_dense_replace` layers dense. The bias is kept as loaded (transformers never
    changes it): megatron's aux-loss-free bias update is off (rate 0)."""
    groups = int(hf_config.n_group or 1)
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=int(hf_config.topk_group) if groups > 1 else None,
        moe_router_pre_softmax=False,
        moe_shared_expert_intermediate_size=hf_config.moe_intermediate_size
        * hf_config.n_shared_experts,
        moe_shared_expert_gate=False,
    )


def sparse_layers(hf_config: PretrainedConfig) -> list[bool]:
    """Which layers of a Qwen2/Qwen3-MoE model are MoE layers, as transformers builds them:
    layer i is sparse unless it is in `mlp_only_layers` or (i + 1) is not a multiple of
    `decoder_sparse_step` (the others are dense MLPs of `intermediate_size`; the first k
    dense layers of a DeepSeek-style model are `mlp_only_layers=[0, ..., k-1]`)."""
    if hf_config.model_type in _MLA:  # DeepSeek-V3: the first k layers dense
        k = int(hf_config.first_k_dense_replace or 0)
        return [i >= k for i in range(hf_config.num_hidden_layers)]
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers)]


def block_spec(
    config: TransformerConfig,
    vp_stage: int | None,
    attention_kernel: str = "torch",
    gemma: bool = False,
    windows: tuple[int | None, ...] = (),
    mla: bool = False,
) -> TransformerBlockSubmodules:
    """`windows`: each (global) layer's sliding window, None for full attention; empty =
    full attention everywhere."""
    norm = GemmaRMSNorm if gemma else RMSNorm

    def layer_spec(num_experts: int | None, window: int | None = None) -> ModuleSpec:
        spec = get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            normalization="RMSNorm",
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=mla,
        )
        spec = copy.deepcopy(spec)
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        if mla:  # the latent q and kv norms
            attn = spec.submodules.self_attention.submodules
            attn.q_layernorm = norm
            attn.kv_layernorm = norm
            # The down projections whole on every rank (megatron's own replicated linear, its
            # weight tagged sequence-parallel): the local spec's column-parallel ones gather
            # their output over TP, and the backward of that gather keeps only this rank's
            # columns of the RoPE key's gradient, to which only this rank's heads contributed.
            # Replicated, under sequence parallel, the RoPE key is gathered along the sequence
            # and its gradient reduce-scattered: every head's share arrives.
            attn.linear_q_down_proj = ReplicatedLinear
            attn.linear_kv_down_proj = ReplicatedLinear
        elif config.qk_layernorm:
            spec.submodules.self_attention.submodules.q_layernorm = norm
            spec.submodules.self_attention.submodules.k_layernorm = norm
        if gemma:  # the sandwich norms: residual + norm(attention), residual + norm(mlp)
            post = ModuleSpec(
                module=PostNormAdd,
                params={
                    "config": config,
                    "hidden_size": config.hidden_size,
                    "eps": config.layernorm_epsilon,
                },
            )
            spec.submodules.self_attn_bda = post
            spec.submodules.mlp_bda = post
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=SegmentAttention, params={"kernel": attention_kernel, "window": window}
        )
        return spec

    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    freq = config.moe_layer_freq
    if (not config.num_moe_experts or not isinstance(freq, list)) and not windows:
        return TransformerBlockSubmodules(
            layer_specs=[layer_spec(config.num_moe_experts)] * layers, layer_norm=norm
        )
    # per-layer patterns (dense and MoE layers, sliding and full attention): this chunk's slice
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    specs = []
    for i in range(layers):
        sparse = config.num_moe_experts and (not isinstance(freq, list) or freq[offset + i])
        window = windows[offset + i] if windows else None
        specs.append(layer_spec(config.num_moe_experts if sparse else None, window))
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)


def layer_windows(hf_config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window (Mistral: every layer; Gemma-3: its `sliding_attention`
    layers), None for full attention; empty for a model without windows."""
    window = _sliding_window(hf_config)
    if window is None:
        return ()
    if hf_config.model_type in _GEMMA:
        return tuple(window if t == "sliding_attention" else None for t in hf_config.layer_types)
    return (window,) * hf_config.num_hidden_layers


class TephraGPT(torch.nn.Module):
    """One pipeline chunk: a megatron GPTModel plus the policy or value head."""

    inv_freq: torch.Tensor
    """`[n bases, head_dim / 2]` RoPE inverse frequencies (a buffer, set in `__init__`)."""

    def __init__(
        self,
        config: TransformerConfig,
        hf_config: PretrainedConfig,
        role: str,
        vp_stage: int | None,
        temperature: float,
        value_head_seed: int,
        compute_entropy: bool = True,
        attention_kernel: str = "torch",
    ) -> None:
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
        self.role = role
        self.temperature = temperature
        self.compute_entropy = compute_entropy
        # set by the engine's forward for one call when the caller asks for sum_pi_squared
        self.sum_pi_squared = False
        shape = model_shape(hf_config)
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        self.pre_process, self.post_process = pre, post
        self.gpt = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(
                config,
                vp_stage,
                attention_kernel,
                shape.gemma,
                layer_windows(hf_config),
                shape.mla,
            ),
            vocab_size=shape.vocab_size,
            max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=shape.tie_word_embeddings and role == "policy",
            position_embedding_type="rope",
            rotary_base=rope_theta(hf_config),
            parallel_output=True,
            vp_stage=vp_stage,
        )
        self.value_head: torch.nn.Linear | None = None  # the critic's, on the last stage
        if role == "value" and post:
            self.gpt.output_layer = None  # the critic reads the final hidden state instead
            g = torch.Generator().manual_seed(value_head_seed)
            head = torch.nn.Linear(shape.hidden_size, 1, bias=False, dtype=config.params_dtype)
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.02)
            self.value_head = head
        # one row of inverse frequencies per distinct RoPE base (one unless Gemma-3)
        ropes = sorted(set(shape.layer_ropes))
        if ropes:
            exponents = torch.arange(0, shape.head_dim, 2, dtype=torch.float32) / shape.head_dim
            # linear scaling divides the frequencies (transformers: `inv_freq /= factor`)
            inv = torch.stack([1.0 / (base**exponents) / factor for base, factor in ropes])
        else:
            inv = rope_frequencies(hf_config)[0][None]
        self.register_buffer("inv_freq", inv, persistent=False)
        if shape.mla:
            attention_factor = rope_frequencies(hf_config)[1]
            for layer in self.gpt.decoder.layers:
                mla_rope = MLARope(attention_factor)
                layer.self_attention.rotary_pos_emb = mla_rope
                layer.self_attention.register_forward_pre_hook(
                    partial(_hand_rope, mla_rope), with_kwargs=True
                )
        if len(ropes) > 1:
            for layer in self.gpt.decoder.layers:
                rope = shape.layer_ropes[layer.layer_number - 1]  # global, 1-based
                layer.self_attention.register_forward_pre_hook(
                    partial(_pick_rope, ropes.index(rope), shape.head_dim), with_kwargs=True
                )
        # Gemma scales the embedding output by sqrt(hidden) (in the weights' dtype, as HF)
        self.embed_scale = shape.hidden_size**0.5 if shape.gemma else None

    def hf_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors that hold HF weights: the parameters, and the routers' `expert_bias`
        buffers (DeepSeek-V3's `e_score_correction_bias`, a buffer in transformers too)."""
        buffers = [(n, b) for n, b in self.named_buffers() if n.endswith("router.expert_bias")]
        return [*self.named_parameters(), *buffers]

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        self.gpt.set_input_tensor(input_tensor)

    # megatron's finalize_model_grads finds the tied embedding through the chunk that owns
    # `pre_process` (this wrapper), so it answers for the GPTModel inside
    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.gpt.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.gpt.shared_embedding_or_output_weight()

    def rotary(self, position_ids: torch.Tensor) -> torch.Tensor:
        """RoPE angles from the batch's own position ids (they restart per packed sequence
        and skip left padding): `[s, b, 1, head_dim]`.
        With several RoPE bases the tables are concatenated on the last dim (`[s, b, 1,
        n * head_dim]`); each layer's pre-hook (`_pick_rope`) takes its own.
        """
        freqs = position_ids.t().float()[..., None, None] * self.inv_freq  # [s, b, n, hd/2]
        return torch.cat([freqs, freqs], dim=-1).flatten(2)[:, :, None, :]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, position_ids, labels `[b, s]` (this CP rank's positions);
        attention_mask: the attention plan `[n, 5]` (`core_attention.attention_plan`)."""
        decoder_input = None
        if self.pre_process:
            decoder_input = self.gpt.embedding(input_ids=input_ids, position_ids=None)
            if self.embed_scale is not None:
                # HF keeps the scale as a float32 tensor and casts it to the weights' dtype
                scale = torch.tensor(self.embed_scale, dtype=torch.float32)
                decoder_input = decoder_input * scale.to(decoder_input.dtype)
        hidden = self.gpt.decoder(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            rotary_pos_emb=self.rotary(position_ids),
        )
        if not self.post_process:
            return hidden
        # hidden [s, b, h] (sequence-sharded under sequence parallel)
        if self.value_head is not None:  # the critic (role == "value")
            if self.config.sequence_parallel:
                hidden = gather_from_sequence_parallel_region(
                    hidden, tensor_parallel_output_grad=False
                )
            return self.value_head(hidden).float().transpose(0, 1)  # [b, s, 1]
        if self.config.sequence_parallel:
            # the kernel's hidden gradient is already summed over TP: split it, do not reduce
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        weight = (
            self.gpt.shared_embedding_or_output_weight()
            if self.gpt.share_embeddings_and_output_weights
            else self.gpt.output_layer.weight
        )
        s, b, h = hidden.shape
        outs = vocab_parallel_logprob_entropy(
            hidden.transpose(0, 1).reshape(b * s, h),
            weight,
            labels.reshape(b * s),
            parallel_state.get_tensor_model_parallel_group(),
            temperature=self.temperature,
            compute_entropy=self.compute_entropy,
            compute_sum_pi_squared=self.sum_pi_squared,
        )
        logp, ent = outs[0], outs[1]
        if ent is None:
            ent = torch.zeros_like(logp)
        # [b, s, k]: log-probs, entropy, then sum pi^2 when asked (the engine's output keys)
        return torch.stack([logp, ent, *outs[2:]], dim=-1).reshape(b, s, -1)


def _pick_rope(
    index: int,
    head_dim: int,
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of one layer's attention: its own RoPE table out of the
    concatenated ones (`TephraGPT.rotary`)."""
    table = kwargs["rotary_pos_emb"]
    kwargs["rotary_pos_emb"] = table[..., index * head_dim : (index + 1) * head_dim]
    return args, kwargs


class MLARope(torch.nn.Module):
    """megatron MLA's rotary embedding, answered with the angles of the batch's own position
    ids (`TephraGPT.rotary`, handed over by `_hand_rope`): megatron's would number the
    positions 0..s-1 of each row, wrong for packed sequences and left padding. Returns
    (angles `[s, b, 1, qk_rope_head_dim]`, YaRN's attention factor), which megatron's MLA
    applies to the RoPE parts of queries and keys, as transformers scales cos and sin."""

    def __init__(self, attention_factor: float) -> None:
        super().__init__()
        self.attention_factor = attention_factor
        self.angles: torch.Tensor | None = None

    def get_rotary_seq_len(self, *_: Any, **__: Any) -> int:
        assert self.angles is not None, "the layer's pre-hook hands over the angles"
        return int(self.angles.shape[0])

    def forward(self, seq_len: int, packed_seq: bool = False) -> tuple[torch.Tensor, float]:
        assert self.angles is not None, "the layer's pre-hook hands over the angles"
        return self.angles, self.attention_factor


def _hand_rope(
    rope: MLARope,
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of an MLA attention: the batch's RoPE angles go to its `MLARope`
    (megatron's MLA refuses them as an argument)."""
    rope.angles = kwargs["rotary_pos_emb"]
    kwargs["rotary_pos_emb"] = None
    return args, kwargs
