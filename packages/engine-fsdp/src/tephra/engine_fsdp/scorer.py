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


def check_output_head(hf_model: PreTrainedModel, role: str, where: str) -> None:
    """Refuse policy heads the scorer would get wrong: it computes logits as `W h` (no
    bias, no soft-capping) inside `tephra.kernels`, never through the model's own head."""
    if role != "policy":
        return
    head = hf_model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ConfigError(
            f"{where}: the output head has a bias, which engine=fsdp's log-prob kernel "
            "(logits = W h) does not add; use a model without an lm_head bias"
        )
    cap = getattr(hf_model.config.get_text_config(), "final_logit_softcapping", None)
    if cap:
        raise ConfigError(
            f"{where}: final_logit_softcapping={cap} (e.g. Gemma 2) is not applied by "
            "engine=fsdp's log-prob kernel; set final_logit_softcapping=None in the model "
            "config or use a model without logit soft-capping"
        )


class TokenScorer(nn.Module):
    """Wraps the trained model (`self.model`: the HF model, or the peft model around it).

    forward(input_ids [b, t], position_ids [b, t], attention_mask [b, t] or None,
            label_mask [b, t], next_tokens [b, t] or None (default: input_ids shifted
            left by one), tree: a `prefix_sharing.TreeLayout` of these rows or None)
    -> dict of `[n]` float32 tensors for the n positions where `label_mask` is 1 (hidden state t, predicting token t + 1), in row-major order:
      policy: `log_probs` = log softmax(W h_t / temperature)[token_{t+1}], `entropy`
              = -sum_v p_v log p_v of that distribution (when `compute_entropy`),
              `sum_pi_squared` = sum_v p_v^2 (when the `sum_pi_squared` argument is True);
      value:  `values` = score(h_t).
    `anchor` is a zero that depends on every output weight and on the hidden states; adding
    it to the loss gives every rank gradients for the same parameters even when its
    micro-batch has no trained position (FSDP's reduce-scatter needs that).
    """

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
            return self._hf.get_output_embeddings()
        return getattr(self._hf, VALUE_HEAD)

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        label_mask,
        next_tokens=None,
        tree=None,
        idle_vision=None,
        sum_pi_squared=False,
        **vision,
    ):
        # vision: pixel_values / image_grid_thw of a vision-language model (see `vision`);
        # idle_vision: a blank image run through the tower only to join the ranks' collectives
        model = backbone(self._hf)
        idle = 0.0
        if idle_vision is not None:  # first, as with real images: the ranks' collectives
            features = model.get_image_features(**idle_vision).pooler_output  # run in order
            idle = sum(f.sum() for f in features) * 0.0
        select = label_mask.bool()
        if next_tokens is None:  # else given: under Ulysses a shard's last token has its
            next_tokens = torch.zeros_like(input_ids)  # successor on the next rank
            next_tokens[..., :-1] = input_ids[..., 1:]
        if tree is not None:  # one row per shared prefix (`prefix_sharing`)
            if tree.attention_mask is None:  # flat: the blocks are the attention
                mask, blocks = (
                    tree_attention.placeholder_mask(tree.input_ids),
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
        outs = kernels.linear_logprob_entropy(
            h,
            head.weight,
            next_tokens[select],
            self.temperature,
            compute_entropy=self.compute_entropy,
            compute_sum_pi_squared=sum_pi_squared,
        )
        log_probs, entropy = outs[0], outs[1]
        # clones: FSDP2 warns about views returned from a wrapped module
        result = {"log_probs": log_probs.float().clone(), "anchor": anchor}
        if self.compute_entropy:
            result["entropy"] = entropy.float().clone()
        if sum_pi_squared:
            result["sum_pi_squared"] = outs[2].float().clone()
        return result

    def _tree_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """SDPA takes the boolean mask; eager attention adds it, so it gets 0 / -inf-like."""
        if self._hf.config._attn_implementation != "eager":
            return allowed
        dtype = self._hf.get_input_embeddings().weight.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
