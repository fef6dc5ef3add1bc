"""Multi-process tests: the conformance kit under each parallel layout (2 gloo ranks each),
and cross-backend parity of the first step against a single-process transformers model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tephra.engine_api.testing import nll_loss_fn, random_batch, run_distributed
from tephra.engine_megatron import testing as T

pytestmark = pytest.mark.multiproc


def _hf_folder(tmp_path):
    ref = T.HFReference(T.TINY_DENSE, init_seed=3)
    folder = tmp_path / "hf"
    ref.model.save_pretrained(folder)
    return ref, folder


def _reference_first_step(model, batch):
    """Plain autograd on the transformers model with the kit's NLL loss."""
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits.float()
    logp = torch.log_softmax(logits, -1)
    ids = batch["input_ids"]
    lp = torch.zeros(ids.shape)
    lp[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = batch["response_mask"].float()
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    ent = torch.zeros(ids.shape)
    ent[:, 1:] = -(logp[:, :-1].exp() * logp[:, :-1]).sum(-1)
    return float(loss), float(norm), lp.detach() * mask, ent.detach() * mask


def test_tp2_conformance_parity_and_round_trip(tmp_path):
    """TP=2 + sequence parallel: the whole kit; then, from an HF folder through
    get_engine('megatron'): log-probs/entropy equal HF (1e-5), first-step loss (1e-5) and
    grad norm (1e-4) equal plain autograd on the transformers model, export_hf writes the
    very same tensors (HF -> Megatron -> HF exact)."""
    ref, folder = _hf_folder(tmp_path)
    batch = random_batch(T.TINY_DENSE["vocab_size"], num_sequences=6, seed=5)
    want_loss, want_norm, want_lp, want_ent = _reference_first_step(ref.model, batch)
    parallel = {"tensor": 2, "sequence_parallel": True}
    results = run_distributed(T.rank_conformance, 2,
                              (T.TINY_DENSE, parallel, str(tmp_path / "ck")))
    assert all(len(r) == 8 for r in results)
    results = run_distributed(T.rank_first_step, 2,
                              (str(folder), {"tensor": 2}, batch, str(tmp_path / "out")))
    for loss, norm, out in results:
        assert abs(loss - want_loss) <= 1e-5
        assert abs(norm - want_norm) <= 1e-4
        assert (out["log_probs"] - want_lp).abs().max() <= 1e-5
        assert (out["entropy"] - want_ent).abs().max() <= 1e-5
    original = load_file(folder / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
