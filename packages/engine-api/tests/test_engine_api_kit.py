"""The conformance kit passes on the reference engine and catches deliberate breakage."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tephra.engine_api import Capability, ConfigError, apply_overrides
from tephra.engine_api import batch as B
from tephra.engine_api.adapters import LoraAdapter
from tephra.engine_api.testing import (
    CHECKS,
    ConformanceFailure,
    random_batch,
    reference_log_probs,
    run_conformance,
)


def test_reference_engine_passes_every_check(make_spec):
    assert run_conformance(make_spec()) == list(CHECKS)


def _broken(reference_engine_cls, name):
    """Subclasses of the reference engine, each breaking one promise of the contract."""
    base = reference_engine_cls

    class OffByOne(base):  # log-prob of token t computed from the hidden state at t
        def _outputs(self, batch, extra_outputs=()):
            out = super()._outputs(batch, extra_outputs)
            out["log_probs"] = torch.roll(out["log_probs"], 1, dims=1) * batch[B.RESPONSE_MASK]
            return out

    class MeanPerMicroBatch(base):  # ignores the global normaliser: per-micro-batch means
        def forward_backward(self, batch, loss_fn):
            B.validate_batch(batch)
            mbs = B.split_by_token_budget(
                batch, self.config.micro_batch.max_tokens_per_microbatch, True
            )
            total = 0.0
            for mb in mbs:
                out = self._outputs(mb)
                mask = mb[B.RESPONSE_MASK].float()
                loss = -(out["log_probs"] * mask).sum() / mask.sum()
                loss.backward()
                total += float(loss.detach()) / len(mbs)
            return {"loss": total}

    class ForgetsOptimizerState(base):
        def _state(self):
            state = super()._state()
            state["optimizer"] = torch.optim.AdamW(self.model.parameters()).state_dict()
            return state

    class GraphInForward(base):
        def forward(self, batch):
            return self._outputs(batch)

    class NoValidation(base):
        def forward(self, batch):
            with torch.no_grad():
                return self._outputs(batch) if B.INPUT_IDS in batch.keys() else None

        def forward_backward(self, batch, loss_fn):
            return {"loss": 0.0}

    class SquaresWithoutTemperature(base):  # sum_pi_squared of the unscaled logits
        def forward(self, batch, *, extra_outputs=()):
            out = super().forward(batch, extra_outputs=extra_outputs)
            if "sum_pi_squared" in out.keys():
                self.config.temperature, t = 1.0, self.config.temperature
                out["sum_pi_squared"] = super().forward(batch, extra_outputs=extra_outputs)[
                    "sum_pi_squared"
                ]
                self.config.temperature = t
            return out

    class StaleExport(base):  # exports the initial weights, not the trained ones
        def export_weights(self, bucket_bytes=0, untie_word_embeddings=False):
            yield list(type(self.model)(0).state_dict().items())

    class ForgetsPacking(base):  # packs by concatenating without restarting positions
        def _outputs(self, batch, extra_outputs=()):
            if not self.config.micro_batch.use_packing:
                return super()._outputs(batch, extra_outputs)
            shifted = batch.clone()
            shifted[B.POSITION_IDS] = shifted[B.POSITION_IDS] + 1
            return super()._outputs(shifted, extra_outputs)

    class SilentAboutLora(base):  # no Capability.LORA, yet its check_config accepts lora.rank
        @classmethod
        def check_config(cls, config, world_size=1):
            pass

    class NoOutputRank(base):  # nobody hands the results back
        @property
        def is_dp_output_rank(self):
            return False

    return {
        "silent_about_lora": (SilentAboutLora, "reference_mode_is_base_model"),
        "no_output_rank": (NoOutputRank, "data_parallel_coordinates"),
        "off_by_one": (OffByOne, "forward_matches_reference"),
        "mean_per_micro_batch": (MeanPerMicroBatch, "grad_accumulation_matches"),
        "forgets_optimizer_state": (ForgetsOptimizerState, "checkpoint_resume_identical"),
        "graph_in_forward": (GraphInForward, "forward_builds_no_graph"),
        "no_validation": (NoValidation, "malformed_batches_raise"),
        "stale_export": (StaleExport, "exported_weights_match"),
        "squares_without_temperature": (SquaresWithoutTemperature, "forward_sum_pi_squared"),
        "forgets_packing": (ForgetsPacking, "packed_equals_padded"),
    }[name]


@pytest.mark.parametrize(
    "breakage",
    [
        "off_by_one",
        "mean_per_micro_batch",
        "forgets_optimizer_state",
        "graph_in_forward",
        "no_validation",
        "stale_export",
        "forgets_packing",
        "squares_without_temperature",
        "silent_about_lora",
        "no_output_rank",
    ],
)
def test_kit_catches_broken_engine(make_spec, reference_engine_cls, breakage):
    engine_cls, check = _broken(reference_engine_cls, breakage)
    with pytest.raises(ConformanceFailure) as info:
        run_conformance(make_spec(engine_cls), checks=[check])
    assert check in str(info.value)


def test_kit_reference_log_probs_are_hand_checkable(make_spec):
    """The kit's naive log-prob equals log_softmax by hand on one position."""

    spec = make_spec()
    ref = spec.make_reference()
    batch = random_batch(spec.vocab_size, num_sequences=2, seed=3)
    lp, _ = reference_log_probs(ref, batch, temperature=0.5)
    i, t = (batch[B.RESPONSE_MASK] == 1).nonzero()[0].tolist()
    with torch.no_grad():
        logits = ref.logits(batch[B.INPUT_IDS], batch[B.ATTENTION_MASK], batch[B.POSITION_IDS])
    want = F.log_softmax(logits[i, t - 1].double() / 0.5, -1)[batch[B.INPUT_IDS][i, t]]
    assert abs(float(lp[i, t]) - float(want)) < 1e-12


def test_the_contract_refuses_what_a_backend_does_not_declare(make_spec):
    """The `Engine` defaults: without `Capability.LORA`, `lora.rank > 0`, `reference_mode()`
    `export_adapter()` and `load_adapter_weights()` raise ConfigErrors naming the option or method and the capability."""

    engine = make_spec().make_engine({})
    assert engine.capabilities == frozenset()
    with pytest.raises(ConfigError, match=r"lora.rank=4: ReferenceEngine has no LoRA support"):
        type(engine).check_config(apply_overrides(engine.config, {"lora.rank": 4}))
    with pytest.raises(ConfigError, match=r"reference_mode\(\) needs Capability.LORA"):
        engine.reference_mode()
    with pytest.raises(ConfigError, match=r"export_adapter\(\) needs Capability.LORA"):
        engine.export_adapter("unused")
    with pytest.raises(ConfigError, match=r"load_adapter_weights\(\) needs Capability.LORA"):
        engine.load_adapter_weights(LoraAdapter(rank=4, alpha=8.0, tensors={}))
    assert Capability("lora") is Capability.LORA
