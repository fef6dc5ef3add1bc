"""A server's automatic launch settings (`tephra.rollout.colocation`): unchanged on CPU, sized
to the trainer's peak for a server colocated on a GPU, an explicit value always winning; the
numbers below are worked out by hand from the module's rule."""

from __future__ import annotations

import pytest

from tephra.engine_api.errors import ConfigError
from tephra.rollout import RolloutConfig, ServerSettings
from tephra.rollout.backends import SglangProtocol, VllmProtocol
from tephra.rollout.colocation import ColocatedBudget, resolve_server_settings

GIB = 1024**3
# one rank's trainer peak of 30 GiB on an 80 GiB GPU, a 3 GiB server
BUDGET = ColocatedBudget(
    trainer_peak_bytes=30 * GIB,
    gpu_total_bytes=80 * GIB,
    server_weight_bytes=3 * GIB,
    basis="estimated from a test",
)


def test_cpu_keeps_eager_no_sleep_and_the_servers_memory_default():
    for budget in (None, BUDGET):  # colocated or not, CPU is what it was
        out = resolve_server_settings(ServerSettings(), "vllm", "cpu", budget)
        assert (out.settings.enforce_eager, out.settings.sleep_level) == (True, 0)
        assert out.settings.gpu_memory_utilization is None and out.note is None
    command = " ".join(
        VllmProtocol().launch_command(
            "py", "m", "h", 9, RolloutConfig(model_path="m"), ServerSettings()
        )
    )
    assert "--enforce-eager" in command and "--enable-sleep-mode" not in command
    assert "--gpu-memory-utilization" not in command


def test_a_colocated_gpu_server_is_sized_to_the_trainers_peak():
    out = resolve_server_settings(ServerSettings(), "vllm", "cuda:0", BUDGET)
    # (80 - 30 - 2 reserve) / 80 = 48 / 80 = 0.60
    assert out.settings.gpu_memory_utilization == 0.6
    assert (out.settings.sleep_level, out.settings.enforce_eager) == (1, False)
    assert out.note == (
        "colocated vllm on cuda: gpu_memory_utilization=0.60 (auto: trainer peak 30.0 GiB of "
        "80.0 GiB, estimated from a test; 2 GiB reserve), sleep_level=1 (auto), cuda graphs "
        "on (auto)"
    )
    command = " ".join(
        VllmProtocol().launch_command(
            "py", "m", "h", 9, RolloutConfig(model_path="m"), out.settings
        )
    )
    assert "--gpu-memory-utilization 0.6" in command and "--enable-sleep-mode" in command
    assert "--enforce-eager" not in command
    sglang = " ".join(
        SglangProtocol().launch_command(
            "py", "m", "h", 9, RolloutConfig(model_path="m"), out.settings
        )
    )
    assert "--mem-fraction-static 0.6" in sglang and "--enable-weights-cpu-backup" in sglang
    assert "--disable-cuda-graph" not in sglang


@pytest.mark.parametrize(
    ("peak_gib", "total_gib", "expected"),
    [
        (20.5, 100, 0.77),  # 77.5 / 100 = 0.775, rounded down
        (1, 80, 0.9),  # 77 / 80 = 0.9625, capped at vLLM's own 0.9
        (60, 139.8, 0.55),  # 77.8 / 139.8 = 0.5565...
    ],
)
def test_the_share_rounds_down_and_never_exceeds_vllms_default(peak_gib, total_gib, expected):
    budget = ColocatedBudget(int(peak_gib * GIB), int(total_gib * GIB), 3 * GIB, "b")
    out = resolve_server_settings(ServerSettings(), "sglang", "cuda", budget)
    assert out.settings.gpu_memory_utilization == expected


def test_an_explicit_value_always_wins():
    given = ServerSettings(gpu_memory_utilization=0.3, sleep_level=0, enforce_eager=True)
    out = resolve_server_settings(given, "vllm", "cuda", BUDGET)
    assert (out.settings.gpu_memory_utilization, out.settings.sleep_level) == (0.3, 0)
    assert out.settings.enforce_eager is True
    assert out.note == (
        "colocated vllm on cuda: gpu_memory_utilization=0.30 (set), sleep_level=0 (set), "
        "eager (set)"
    )
    # an explicit share is used even where the estimate would leave no room
    full = ColocatedBudget(79 * GIB, 80 * GIB, 3 * GIB, "b")
    assert resolve_server_settings(given, "vllm", "cuda", full).settings == given


def test_a_server_of_its_own_or_elsewhere_keeps_the_servers_defaults_but_gets_graphs():
    alone = resolve_server_settings(ServerSettings(), "vllm", "cuda", None)
    assert (alone.settings.sleep_level, alone.settings.enforce_eager) == (0, False)
    assert alone.settings.gpu_memory_utilization is None and alone.note is None
    remote = ServerSettings(url="http://10.0.0.5:8000")
    out = resolve_server_settings(remote, "vllm", "cuda", BUDGET)
    assert out.settings.sleep_level == 0 and out.note is None


def test_no_room_for_the_server_is_refused_naming_the_field_and_the_fixes():
    # 80 - 70 - 2 = 8 GiB left < 8 GiB of weights + 1 GiB of KV cache
    budget = ColocatedBudget(70 * GIB, 80 * GIB, 8 * GIB, "estimated from 7B params")
    with pytest.raises(
        ConfigError,
        match=r"rollout\.vllm\.gpu_memory_utilization: the trainer's estimated peak 70\.0 GiB "
        r"\(estimated from 7B params\) \+ 2 GiB reserve leaves 8\.0 GiB of the GPU's 80\.0 "
        r"GiB, less than the colocated server's weights 8\.0 GiB \+ 1 GiB of KV cache; .*"
        r"actor\.offload\.optimizer=true.* or set rollout\.vllm\.gpu_memory_utilization",
    ):
        resolve_server_settings(ServerSettings(), "vllm", "cuda", budget)
    # one GiB more of GPU is enough
    ok = ColocatedBudget(70 * GIB, 81 * GIB, 8 * GIB, "b")
    assert resolve_server_settings(ServerSettings(), "vllm", "cuda", ok).settings.sleep_level == 1


def test_ranks_sharing_a_gpu_split_what_their_trainers_leave():
    # two ranks on one 80 GiB GPU, each trainer 10 GiB: (80 - 2 x (10 + 2)) / 2 = 28 GiB each
    budget = ColocatedBudget(10 * GIB, 80 * GIB, 3 * GIB, "b", sharing=2)
    out = resolve_server_settings(ServerSettings(), "vllm", "cuda", budget)
    assert out.settings.gpu_memory_utilization == 0.35  # 28 / 80
    assert out.note is not None and "of 80.0 GiB, 2 ranks per GPU, b;" in out.note
    # four ranks of 17 GiB: (80 - 4 x 19) / 4 = 1 GiB each, short of 3 GiB + 1 GiB of KV cache
    crowded = ColocatedBudget(17 * GIB, 80 * GIB, 3 * GIB, "b", sharing=4)
    with pytest.raises(ConfigError, match=r"2 GiB reserve for each of 4 ranks sharing the GPU"):
        resolve_server_settings(ServerSettings(), "vllm", "cuda", crowded)
