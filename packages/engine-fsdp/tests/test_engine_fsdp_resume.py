"""save -> kill the process -> load in a fresh engine -> step: bitwise the same loss and
grad norm as a run that never stopped (model, AdamW moments, cosine schedule, RNG)."""

import signal
import subprocess
import sys
import textwrap

from tephra.engine_api.testing import random_batch
from tephra.engine_fsdp import FSDPEngine
from tephra.engine_fsdp.testing import TINY_VOCAB, tiny_engine_config, train_step

OVERRIDES = {
    "scheduler.name": "cosine",
    "scheduler.warmup_steps": 1,
    "scheduler.total_steps": 5,
    "micro_batch.max_tokens_per_microbatch": 24,
}

TRAIN_SAVE_DIE = textwrap.dedent("""
    import os, signal, sys, torch
    torch.set_num_threads(1)
    from tephra.engine_api.testing import random_batch
    from tephra.engine_fsdp import FSDPEngine
    from tephra.engine_fsdp.testing import TINY_VOCAB, tiny_engine_config, train_step
    engine = FSDPEngine.build(tiny_engine_config(**{overrides!r}))
    for seed in (1, 2):
        train_step(engine, random_batch(TINY_VOCAB, num_sequences=8, seed=seed))
    engine.save_checkpoint(sys.argv[1])
    os.kill(os.getpid(), signal.SIGKILL)
""").format(overrides=OVERRIDES)


def test_save_kill_load_step_is_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN_SAVE_DIE, str(ckpt)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    uninterrupted = FSDPEngine.build(tiny_engine_config(**OVERRIDES))
    for seed in (1, 2):
        train_step(uninterrupted, random_batch(TINY_VOCAB, num_sequences=8, seed=seed))
    resumed = FSDPEngine.build(tiny_engine_config(**OVERRIDES))
    resumed.load_checkpoint(ckpt)
    assert resumed.step == 2
    for seed in (3, 4):
        batch = random_batch(TINY_VOCAB, num_sequences=8, seed=seed)
        want = train_step(uninterrupted, batch)
        got = train_step(resumed, batch)
        assert got == want
    assert resumed.scheduler.get_last_lr() == uninterrupted.scheduler.get_last_lr()
