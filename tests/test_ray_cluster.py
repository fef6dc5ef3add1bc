"""A real two-node Ray cluster on this machine (two raylets, `ray.cluster_utils.Cluster`): a
worker group placed one rank per node joins one process group with the rendezvous on rank 0's
node, and the app's smoke preset trains with its ranks on both nodes."""

from __future__ import annotations

import pytest

from tephra.controller.testing import SMOKE_REWARD


@pytest.mark.multiproc
def test_smoke_preset_trains_across_two_nodes(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    from tephra.apps.ppo.main import parse_config, run
    from tephra.controller.trackers import read_jsonl

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)
    try:
        summary = run(
            parse_config(
                [
                    "-p",
                    "smoke",
                    f"reward.custom_function_path={reward}",
                    f"resources.ray_address={cluster.address}",
                    "resources.world_size=2",
                    "resources.placement=STRICT_SPREAD",
                    f"trainer.run_dir={tmp_path / 'run'}",
                ]
            )
        )
        assert len(ray.nodes()) == 2
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert summary["nodes"] == 2 and summary["steps"] == 2
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)
