"""A minimal single-process reference engine, kept here to prove the conformance kit.

`ReferenceEngine` implements the Engine contract on a tiny pure-torch causal LM that runs
each sequence on its own (so packing is trivially exact). Fixtures hand the class and a
spec builder to the tests; broken subclasses in the tests show that the kit catches them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tensordict import TensorDict

from tephra.engine_api import batch as B
from tephra.engine_api.config import EngineConfig, ModelConfig, OptimizerConfig, apply_overrides
from tephra.engine_api.engine import Engine
from tephra.engine_api.errors import CheckpointError
from tephra.engine_api.forward_outputs import check_extra_outputs
from tephra.engine_api.loss import reduce_metrics, shares_of
from tephra.engine_api.testing import ConformanceSpec

VOCAB, HIDDEN, MAX_POS = 50, 16, 64


class TinyCausalLM(nn.Module):
    """Embeddings + one causal self-attention layer + MLP + untied head, HF-like names."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.embed_positions = nn.Embedding(MAX_POS, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.mlp = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One sequence `[T]` -> logits `[T, V]`."""
        h = self.embed_tokens(ids) + self.embed_positions(pos)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = h + F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        h = h + torch.tanh(self.mlp(h))
        return self.lm_head(h)


class TinyReference:
    """The kit's ReferenceModel for TinyCausalLM."""

    def __init__(self) -> None:
        self.model = TinyCausalLM()

    def load_weights(self, weights) -> None:
        self.model.load_state_dict(dict(weights))

    def logits(self, input_ids, attention_mask, position_ids):
        out = torch.zeros(*input_ids.shape, VOCAB)
        for i in range(input_ids.shape[0]):
            real = attention_mask[i].bool()
            out[i, real] = self.model(input_ids[i, real], position_ids[i, real])
        return out


class ReferenceEngine(Engine):
    """Single-process (or plain all-reduce DP) engine on TinyCausalLM."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model = TinyCausalLM(config.model.init_seed)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=config.optimizer.lr,
            betas=config.optimizer.betas,
            weight_decay=config.optimizer.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)

    @classmethod
    def build(cls, config: EngineConfig) -> ReferenceEngine:
        return cls(config)

    @contextlib.contextmanager
    def train_mode(self):
        self.model.train()
        yield

    @contextlib.contextmanager
    def eval_mode(self):
        self.model.eval()
        yield

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def is_dp_output_rank(self) -> bool:
        return True

    def _outputs(self, batch: TensorDict, extra_outputs=()) -> TensorDict:
        ids, attn, pos = batch[B.INPUT_IDS], batch[B.ATTENTION_MASK], batch[B.POSITION_IDS]
        lp_rows, ent_rows, q_rows = [], [], []
        for i in range(ids.shape[0]):
            real = attn[i].bool()
            logits = self.model(ids[i, real], pos[i, real]) / self.config.temperature
            logp = F.log_softmax(logits.float(), dim=-1)
            zero = torch.zeros(1)
            tok_lp = torch.cat([zero, logp[:-1].gather(-1, ids[i, real][1:, None]).squeeze(-1)])
            tok_ent = torch.cat([zero, -(logp[:-1].exp() * logp[:-1]).sum(-1)])
            lp_rows.append(self._place(real, tok_lp))
            ent_rows.append(self._place(real, tok_ent))
            tok_q = torch.cat([zero, logp[:-1].exp().pow(2).sum(-1)])
            q_rows.append(self._place(real, tok_q))
        mask = batch[B.RESPONSE_MASK].float()
        lp, ent = torch.stack(lp_rows) * mask, torch.stack(ent_rows) * mask
        out = {"log_probs": lp, "entropy": ent}
        if "sum_pi_squared" in extra_outputs:
            out["sum_pi_squared"] = torch.stack(q_rows) * mask
        return TensorDict(out, batch_size=batch.batch_size)

    @staticmethod
    def _place(real: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(real.shape, dtype=values.dtype)
        return out.masked_scatter(real, values)

    def forward(self, batch: TensorDict, *, extra_outputs=()) -> TensorDict:
        B.validate_batch(batch)
        extra = check_extra_outputs(extra_outputs, self.config.model.role)
        with torch.no_grad():
            return self._outputs(batch, extra)

    def forward_backward(self, batch, loss_fn):
        B.validate_batch(batch)
        mbs = B.split_by_token_budget(
            batch,
            self.config.micro_batch.max_tokens_per_microbatch,
            self.config.micro_batch.packing(True),
        )
        B.set_global_normalisers(mbs)
        total = 0.0
        sums: dict[str, float] = {}
        shares: set[str] = set()
        for mb in mbs:
            loss, metrics = loss_fn(self._outputs(mb), mb)
            loss.backward()
            total += float(loss.detach())
            shares |= shares_of(metrics)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        return {"loss": total, **reduce_metrics(sums, shares, len(mbs))}

    def optimizer_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr_scheduler_step(self) -> float:
        self.scheduler.step()
        return self.scheduler.get_last_lr()[0]

    def export_weights(self, bucket_bytes=512 << 20, untie_word_embeddings=False):
        yield [(k, v.detach()) for k, v in self.model.state_dict().items()]

    def save_checkpoint(self, path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(self._state(), Path(path) / "state.pt")

    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": torch.get_rng_state(),
        }

    def load_checkpoint(self, path) -> None:
        file = Path(path) / "state.pt"
        if not file.exists():
            raise CheckpointError(f"no checkpoint at {path} (expected {file})")
        state = torch.load(file, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])

    def export_hf(self, path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(self.model.state_dict(), Path(path) / "weights.pt")


def base_config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(hf_config={"model_type": "tiny"}),
        optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0, grad_clip=0.0),
        temperature=0.7,
    )


@pytest.fixture
def reference_engine_cls():
    return ReferenceEngine


@pytest.fixture
def make_spec(tmp_path):
    """make_spec(engine_cls) -> ConformanceSpec for that (possibly broken) engine class."""

    def build(engine_cls=ReferenceEngine) -> ConformanceSpec:
        return ConformanceSpec(
            make_engine=lambda overrides: engine_cls.build(
                apply_overrides(base_config(), overrides)
            ),
            make_reference=TinyReference,
            vocab_size=VOCAB,
            workdir=tmp_path,
        )

    return build
