"""`TokenScorer`: the module FSDP wraps at its root. One forward runs the backbone and turns
the hidden states at the requested positions into log-probs/entropy (policy, through
`tephra.kernels`, never materialising `[tokens, vocab]` logits) or values (value head).

It exists so that the output head is used *inside* the root module's forward: FSDP2 gathers
root-level weights (embeddings, final norm, `lm_head` / `score`) in the root's pre-forward
hook, so computing with them outside a forward would read sharded tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

import tephra.kernels as kernels
from tephra.engine_api.errors import ConfigError
from tephra.engine_fsdp import tree_attention
from tephra.engine_fsdp.model_builder import VALUE_HEAD, backbone
from tephra.engine_fsdp.prefix_sharing import TreeLayout
from tephra.engine_fsdp.vision import image_tower

LOGITS_DIVIDED = frozenset(
    {
        "granite",
        "granite_swa",
        "granitemoe",
        "granitemoe_swa",
        "granitemoehybrid",
        "granitemoeshared",
    }
)
"""Families whose head divides the logits by `logits_scaling` (Granite: logits / 16)."""
LOGITS_MULTIPLIED = frozenset({"hyperclovax"})
"""Families whose head multiplies the logits by `logits_scaling` (HyperCLOVA X)."""
HIDDEN_DIVIDED = frozenset({"minicpm3"})
"""Families that divide the last hidden state by `logits_scaling` before the head."""
SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
"""Config fields of a soft-cap on every logit (Gemma 2 ...; RecurrentGemma; xLSTM)."""


def _number(config: object, field: str) -> float | None:
    value = getattr(config, field, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def head_transform_of(hf_model: PreTrainedModel) -> kernels.HeadTransform:
    """What the model's causal-LM forward does around `W h` (the output embeddings' weight
    times the last hidden state), read off its text config: the one place that knows each
    family's field names (transformers' `*ForCausalLM.forward` of each family):
      logit_scale    Cohere, Cohere 2 (MoE), Command-A Compass: logits * logit_scale;
                     Granite: logits / logits_scaling; HyperCLOVA X: logits * logits_scaling;
                     Falcon-H1: logits * lm_head_multiplier
      hidden_scale   MiniCPM3: h / logits_scaling; Inkling: h / logits_mup_width_multiplier
      softcap        final_logit_softcapping (Gemma 2, 3, 3n, 4, VaultGemma, NanoChat, Beam,
                     Inkling 2), logits_soft_cap (RecurrentGemma), output_logit_soft_cap
                     (xLSTM)
      bias           the output head's bias (Phi, GPT-J, CodeGen)
      vocab_size     Inkling, Inkling 2: logits[..., :unpadded_vocab_size]
    """
    config = hf_model.config.get_text_config()
    family = str(getattr(config, "model_type", ""))
    logit_scale, hidden_scale = 1.0, 1.0
    if family.startswith("cohere"):  # logit_scale; Compass leaves it None (no scaling)
        logit_scale = _number(config, "logit_scale") or 1.0
    scaling = _number(config, "logits_scaling")
    if scaling is not None and family in LOGITS_DIVIDED:
        logit_scale = 1.0 / scaling
    if scaling is not None and family in LOGITS_MULTIPLIED:
        logit_scale = scaling
    if scaling is not None and family in HIDDEN_DIVIDED:
        hidden_scale = 1.0 / scaling
    if family == "falcon_h1":
        logit_scale = _number(config, "lm_head_multiplier") or 1.0
    mup = _number(config, "logits_mup_width_multiplier")
    if mup is not None and family == "inkling_text":
        hidden_scale = 1.0 / mup
    softcap = next((c for f in SOFTCAP_FIELDS if (c := _number(config, f))), None)
    head = hf_model.get_output_embeddings()
    rows = head.get_parameter("weight").shape[0]
    unpadded = getattr(config, "unpadded_vocab_size", None)
    cut = unpadded if isinstance(unpadded, int) and 0 < unpadded < rows else None
    bias = getattr(head, "bias", None)
    return kernels.HeadTransform(
        hidden_scale=hidden_scale,
        logit_scale=logit_scale,
        softcap=softcap,
        bias=bias if isinstance(bias, torch.Tensor) else None,
        vocab_size=cut if family.startswith("inkling") else None,
    )


def check_output_head(hf_model: PreTrainedModel, role: str, where: str) -> None:
    """Refuse policy heads the scorer would get wrong: it runs the decoder (`backbone`), then
    the output projection with the model's `head_transform_of` inside `tephra.kernels`, so a
    head with parts of its own between the two (BERT's and RoBERTa's prediction transform:
    dense, activation, norm) would be skipped."""
    if role != "policy":
        return
    decoder = {id(p) for p in backbone(hf_model).parameters()}
    head = {id(p) for p in hf_model.get_output_embeddings().parameters()}
    skipped = [
        name
        for name, p in hf_model.named_parameters()
        if id(p) not in decoder and id(p) not in head
    ]
    if skipped:
        raise ConfigError(
            f"{where}: the output head runs a prediction transform before its output "
            f"projection ({', '.join(skipped[:3])}, ...: e.g. BERT's or RoBERTa's dense, "
            "activation and norm), which engine=fsdp's scorer (decoder, then the output "
            "projection) does not run; use a decoder-only model whose output head is one "
            "linear layer"
        )
    head_transform_of(hf_model)  # a bad value (a logit scale <= 0) fails here, at build


class TokenScorer(nn.Module):
    """Wraps the trained model (`self.model`: the HF model, or the peft model around it).

    forward(input_ids [b, t], position_ids [b, t], attention_mask [b, t] or None,
            label_mask [b, t], next_tokens [b, t] or None (default: input_ids shifted
            left by one), tree: a `prefix_sharing.TreeLayout` of these rows or None)
    -> dict of `[n]` float32 tensors for the n positions where `label_mask` is 1 (hidden state t, predicting token t + 1), in row-major order:
      policy: `log_probs` = log softmax(z_t)[token_{t+1}] with z_t = W h_t / temperature
              and the family's `head_transform_of` (scales, soft-cap, bias), `entropy`
              = -sum_v p_v log p_v of that distribution (when `compute_entropy`),
              `sum_pi_squared` = sum_v p_v^2 (when the `sum_pi_squared` argument is True);
      value:  `values` = score(h_t).
    `anchor` is a zero that depends on every output weight and on the hidden states; adding
    it to the loss gives every rank gradients for the same parameters even when its
    micro-batch has no trained position (FSDP's reduce-scatter needs that).
    """

    _hf: PreTrainedModel
    """The HF model (inside `self.model` when peft wraps it), set by `__init__`."""

    def __init__(
        self,
        model: nn.Module,
        hf_model: PreTrainedModel,
        role: str,
        temperature: float,
        compute_entropy: bool,
    ) -> None:
        super().__init__()
        self.model = model
        self.role = role
        self.temperature = temperature
        self.compute_entropy = compute_entropy
        # plain attributes (not submodules): they are reached through self.model already
        object.__setattr__(self, "_hf", hf_model)

    @property
    def hf_model(self) -> PreTrainedModel:
        return self._hf

    def head(self) -> nn.Module:
        if self.role == "policy":
            head: nn.Module = self._hf.get_output_embeddings()
            return head
        return self._hf.get_submodule(VALUE_HEAD)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        label_mask: torch.Tensor,
        next_tokens: torch.Tensor | None = None,
        tree: TreeLayout | None = None,
        idle_vision: dict[str, torch.Tensor] | None = None,
        sum_pi_squared: bool = False,
        **vision: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        # vision: pixel_values / image_grid_thw of a vision-language model (see `vision`);
        # idle_vision: a blank image run through the tower only to join the ranks' collectives
        model = backbone(self._hf)
        idle: torch.Tensor | float = 0.0
        if idle_vision is not None:  # first, as with real images: the ranks' collectives
            features = image_tower(model).get_image_features(**idle_vision).pooler_output
            idle = sum(f.sum() for f in features) * 0.0  # (run in order)
        select = label_mask.bool()
        if next_tokens is None:  # else given: under Ulysses a shard's last token has its
            next_tokens = torch.zeros_like(input_ids)  # successor on the next rank
            next_tokens[..., :-1] = input_ids[..., 1:]
        if tree is not None:  # one row per shared prefix (`prefix_sharing`)
            if tree.attention_mask is None:  # flat: the blocks are the attention
                mask, blocks = (
                    tree_attention.placeholder_mask(tree.input_ids, tree.blocks),
                    {"tree_blocks": tree.blocks},
                )
            else:
                mask, blocks = self._tree_mask(tree.attention_mask), {}
            hidden = model(
                input_ids=tree.input_ids,
                position_ids=tree.position_ids,
                attention_mask=mask,
                use_cache=False,
                **blocks,
            ).last_hidden_state
            h = hidden.flatten(0, 1)[tree.scored]
        else:
            hidden = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                **vision,
            ).last_hidden_state  # [b, t, hidden]
            h = hidden[select]  # [n, hidden]
        head = self.head()
        anchor = hidden.sum() * 0.0 + sum(p.sum() * 0.0 for p in head.parameters())
        anchor = anchor + idle
        if self.role == "value":
            values = head(h).squeeze(-1).float().clone()
            return {"values": values, "anchor": anchor}
        if h.shape[0] == 0:  # nothing trained in this micro-batch (e.g. a filler)
            empty = hidden.new_zeros(0, dtype=torch.float32)
            result = {"log_probs": empty, "anchor": anchor}
            if self.compute_entropy:
                result["entropy"] = empty
            if sum_pi_squared:
                result["sum_pi_squared"] = empty
            return result
        log_probs, entropy, *sum_sq = kernels.linear_logprob_entropy(
            h,
            head.get_parameter("weight"),
            next_tokens[select],
            self.temperature,
            compute_entropy=self.compute_entropy,
            compute_sum_pi_squared=sum_pi_squared,
            head=head_transform_of(self._hf),  # read here: the bias FSDP gathered
        )
        # clones: FSDP2 warns about views returned from a wrapped module
        result = {"log_probs": log_probs.float().clone(), "anchor": anchor}
        if entropy is not None:  # computed when `compute_entropy`
            result["entropy"] = entropy.float().clone()
        if sum_sq:  # computed when `sum_pi_squared`
            result["sum_pi_squared"] = sum_sq[0].float().clone()
        return result

    def _tree_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """SDPA takes the boolean mask; eager attention adds it, so it gets 0 / -inf-like."""
        if self._hf.config._attn_implementation != "eager":
            return allowed
        dtype = self._hf.get_input_embeddings().get_parameter("weight").dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
