"""Vocab-parallel log-prob/entropy on 2 gloo ranks against the unsharded naive result."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tephra.kernels import KernelInputError, vocab_parallel_logprob_entropy
from tephra.kernels.testing import vocab_parallel_problem, vocab_parallel_worker


@pytest.mark.multiproc
def test_two_gloo_ranks_match_unsharded():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    # raises if a rank fails, so a broken rank never leaves the test waiting on the queue
    mp.spawn(vocab_parallel_worker, args=(2, port, queue), nprocs=2, join=True)
    results = dict(queue.get() for _ in range(2))
    assert sorted(results) == [0, 1]
    assert all(
        sorted(errors) == ["even", "head", "no_entropy", "sum_pi_squared", "uneven"]
        for errors in results.values()
    )
    for rank, errors in results.items():
        for case, errs in errors.items():
            # logp, entropy, grad hidden (all-reduced), this rank's rows of grad weight
            # (and of grad bias, for the transformed head)
            assert max(errs) <= 1e-5, (rank, case, errs)


def test_needs_an_initialised_group(monkeypatch):
    # another test in this process may have left a group initialised
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    h, w, y, _, _ = vocab_parallel_problem()
    with pytest.raises(KernelInputError, match="init_process_group"):
        vocab_parallel_logprob_entropy(h, w, y)
