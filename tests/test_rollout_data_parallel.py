"""Generation has a data parallelism of its own: with megatron TP=2 on 2 ranks (one training
replica) the two ranks generate disjoint halves of the prompts, and the samples gathered
equal those of one in-process hf rollout generating every prompt in one call (the sample
seeds follow each prompt's place in the whole batch)."""

from __future__ import annotations

import pytest
import torch

from tephra.apps.ppo.main import parse_config
from tephra.controller.cluster.dispatch import Dispatch, dispatch
from tephra.controller.cluster.worker_group import ResourcePool, WorkerGroup
from tephra.controller.launch.preflight import resolve_auto_dtypes
from tephra.controller.samples import Prompt
from tephra.controller.testing import SMOKE_REWARD
from tephra.controller.workers.rl_worker import RLWorker
from tephra.rollout import RolloutConfig, SamplingParams, get_rollout
from tephra.rollout.testing import build_tiny_model


class CountingWorker(RLWorker):
    """An `RLWorker` that records the sample ids of every plain generate call it makes."""

    def __init__(self, *args, **kwargs) -> None:
        self.calls: list[list[str]] = []
        super().__init__(*args, **kwargs)
        plain = self.generation._generate_plain  # the worker's generation part generates

        def counted(items, sampling):
            self.calls.append([i.sample_id for i in items])
            return plain(items, sampling)

        self.generation._generate_plain = counted

    @dispatch(Dispatch.BROADCAST)
    def generate_calls(self) -> list[list[str]]:
        return self.calls


@pytest.mark.multiproc
def test_megatron_tp2_ranks_generate_disjoint_halves(ray_session, tmp_path):
    model = build_tiny_model(tmp_path / "dense", num_heads=2, num_kv_heads=2, seed=3)
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)
    cfg = resolve_auto_dtypes(
        parse_config(
            [
                "-p",
                "smoke",
                f"model.path={model.path}",
                "actor.engine=megatron",
                "actor.parallel.tensor=2",
                "resources.world_size=2",
                f"reward.custom_function_path={reward}",
                f"trainer.run_dir={tmp_path / 'run'}",
            ]
        )
    )
    assert cfg.data_parallel_size() == 1  # one training replica over the two ranks
    pool = ResourcePool(world_size=2, cpus_per_rank=1)
    wg = WorkerGroup(CountingWorker, pool, {"cfg": cfg, "model_path": model.path})
    try:
        assert wg.dp_size == 1 and wg.rollout_dp_size == 2
        prompts = [[5 + i, 6, 7 + 2 * i, 9][: 1 + i % 4] for i in range(6)]
        items = [
            Prompt([{"role": "user", "content": "x"}], "d", "1", sample_id=f"s{i}", prompt_ids=p)
            for i, p in enumerate(prompts)
        ]
        sampling = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=42)
        samples = wg.generate(items, sampling)
        assert wg.generate_calls() == [[["s0", "s1", "s2"]], [["s3", "s4", "s5"]]]
        assert len(wg.collect_scores().rewards) == 12
    finally:
        wg.shutdown()
        pool.release()
    with get_rollout(
        "hf", RolloutConfig(model_path=model.path, dtype="float32", max_model_len=128)
    ) as hf:
        want = hf.generate(prompts, sampling)
    assert [s.sample_id for s in samples] == [f"s{i}" for i in range(6) for _ in range(2)]
    assert [s.response_ids for s in samples] == want.response_ids
    torch.testing.assert_close(
        torch.tensor(sum((s.log_probs for s in samples), [])),
        torch.tensor(sum(want.log_probs, [])),
        atol=2e-6,
        rtol=0,
    )
