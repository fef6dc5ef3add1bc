"""Sampling from saved weights: a plain transformers model of the base, loaded with a
client's merged weights (`Engine.export_weights`), decoding token by token with its KV cache.

The log-prob returned with each sampled token is log softmax(logits / temperature) at the
token (the distribution it was drawn from; the raw logits for greedy decoding), what
`importance_sampling` needs as the sampler's log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tephra.apps.serve.errors import UserError
from tephra.engine_api.config import ModelConfig


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_ids: tuple[int, ...]


def build_model(model: ModelConfig) -> PreTrainedModel:
    """The base model in float32, eager attention (exact, no fused kernel differences)."""
    if model.path is not None:
        built = AutoModelForCausalLM.from_pretrained(
            model.path, dtype=torch.float32, attn_implementation="eager"
        )
    else:
        assert model.hf_config is not None
        data = dict(model.hf_config)
        config = AutoConfig.for_model(data.pop("model_type"), **data)
        built = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="eager"
        )
    return built.eval()


class Sampler:
    """One base model's sampling model; `load` swaps in a client's weights."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = build_model(model)
        self.loaded: str | None = None

    def load(self, key: str, weights: dict[str, torch.Tensor]) -> None:
        if self.loaded == key:
            return
        self.model.load_state_dict(weights, strict=False)
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()
        self.loaded = key

    def _next(
        self, logits: torch.Tensor, sampling: Sampling, gen: torch.Generator
    ) -> tuple[int, float]:
        if sampling.temperature == 0:
            log_probs = torch.log_softmax(logits, -1)
            token = int(logits.argmax())
            return token, float(log_probs[token])
        log_probs = torch.log_softmax(logits / sampling.temperature, -1)
        probs = log_probs.exp()
        if sampling.top_k > 0:
            kth = torch.topk(probs, min(sampling.top_k, probs.numel())).values[-1]
            probs = torch.where(probs >= kth, probs, 0.0)
        if sampling.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < sampling.top_p
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
        token = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
        return token, float(log_probs[token])

    @torch.no_grad()
    def sample(
        self, prompt: list[int], n: int, sampling: Sampling
    ) -> list[tuple[list[int], list[float], str]]:
        """`n` samples of `prompt`: `(tokens, logprobs, stop_reason)` each, decoded together
        (one batched forward per token for all `n`); sample j draws from its own generator,
        seeded `seed + j` (random when `seed` is None), so it does not depend on `n`."""
        if not prompt:
            raise UserError("sample: the prompt is empty")
        if n < 1:
            raise UserError(f"sample: num_samples={n}; give 1 or more")
        limit = self.model.config.max_position_embeddings
        if len(prompt) + sampling.max_tokens > limit:
            raise UserError(
                f"sample: prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds the model's context of {limit} tokens"
            )
        gens = []
        for j in range(n):
            gen = torch.Generator()
            if sampling.seed is None:
                gen.seed()
            else:
                gen.manual_seed(sampling.seed + j)
            gens.append(gen)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        done = [False] * n
        # every row has the same prompt: no padding, the rows decode in lockstep
        result = self.model(input_ids=torch.tensor([prompt] * n), use_cache=True)
        for i in range(sampling.max_tokens):
            logits = result.logits[:, -1].float()
            step = []
            for j in range(n):
                token, lp = self._next(logits[j], sampling, gens[j])
                step.append(token)
                if not done[j]:
                    tokens[j].append(token)
                    logprobs[j].append(lp)
                    done[j] = token in sampling.stop_ids
            if all(done) or i == sampling.max_tokens - 1:
                break
            result = self.model(
                input_ids=torch.tensor(step).unsqueeze(1),
                past_key_values=result.past_key_values,
                use_cache=True,
            )
        return [(t, lp, "stop" if d else "length") for t, lp, d in zip(tokens, logprobs, done)]
