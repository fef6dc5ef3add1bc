"""Multi-process tests: the conformance kit under each parallel layout (2 gloo ranks each),
and cross-backend parity of the first step against a single-process transformers model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tephra.engine_api.testing import random_batch, run_distributed
from tephra.engine_megatron import testing as T

pytestmark = pytest.mark.multiproc


def _hf_folder(tmp_path):
    # a pad id: transformers' embedding never trains its row (padding_idx), nor must ours
    ref = T.HFReference({**T.TINY_DENSE, "pad_token_id": 3}, init_seed=3)
    folder = tmp_path / "hf"
    ref.model.save_pretrained(folder)
    return ref, folder


def _reference_first_step(model, batch):
    """Plain autograd on the transformers model with the kit's NLL loss."""
    model.zero_grad()
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits.float()
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
    ids = batch["input_ids"]  # the policy sampled the pad id as real tokens
    ids[batch["response_mask"].bool() & (torch.arange(ids.shape[1]) % 4 == 0)] = 3
    want_loss, want_norm, want_lp, want_ent = _reference_first_step(ref.model, batch)
    parallel = {"tensor": 2, "sequence_parallel": True}
    results = run_distributed(T.rank_conformance, 2, (T.TINY_DENSE, parallel, str(tmp_path / "ck")))
    assert all(len(r) == len(T.KIT_CHECKS) for r in results)
    results = run_distributed(
        T.rank_first_step,
        2,
        (str(folder), {"tensor": 2, "sequence_parallel": True}, batch, str(tmp_path / "out")),
    )
    for loss, norm, out in results:
        assert abs(loss - want_loss) <= 1e-5
        assert abs(norm - want_norm) <= 1e-4
        assert (out["log_probs"] - want_lp).abs().max() <= 1e-5
        assert (out["entropy"] - want_ent).abs().max() <= 1e-5
    original = load_file(folder / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)


def _kit(tmp_path, runs):
    results = run_distributed(T.rank_conformance_runs, 2, (runs, str(tmp_path)))
    for rank_result in results:
        for (model, parallel, disp, checks), passed in zip(runs, rank_result):
            assert len(passed) == (len(checks) if checks else len(T.KIT_CHECKS)), (
                model,
                parallel,
                disp,
            )


def test_pp2_conformance_interleaved_and_1f1b(tmp_path):
    """PP=2 with 2 virtual stages per rank (interleaved 1F1B): the whole kit; plain 1F1B with
    tied embeddings (first stage's embedding = last stage's output layer): log-probs, a step,
    gradient accumulation and export after the step (the two copies stay equal)."""
    _kit(
        tmp_path,
        [
            ("dense", {"pipeline": 2, "virtual_pipeline": 2}, "alltoall", None),
            (
                "dense_tied",
                {"pipeline": 2},
                "alltoall",
                [
                    "forward_matches_reference",
                    "optimizer_step_lowers_loss",
                    "grad_accumulation_matches",
                    "exported_weights_match",
                ],
            ),
        ],
    )


def test_ep2_moe_conformance(tmp_path):
    """Qwen2-MoE, EP=2 with the alltoall dispatcher: the whole kit; the allgather dispatcher
    and expert tensor parallel (ETP=2): log-probs, gradient accumulation and export."""
    core = ["forward_matches_reference", "grad_accumulation_matches", "exported_weights_match"]
    _kit(
        tmp_path,
        [
            ("moe", {"expert": 2}, "alltoall", None),
            ("moe", {"expert": 2}, "allgather", core),
            ("moe", {"expert_tensor": 2}, "alltoall", core),
        ],
    )


def test_cp2_conformance(tmp_path):
    """CP=2 through the torch core attention (K/V all-gathered in the load-balanced
    layout): the whole kit."""
    _kit(tmp_path, [("dense", {"context": 2}, "alltoall", None)])
