"""Every bad option of the RL trainer's config is one clear message naming the field, the
value and the fix, raised while the config loads: before Ray starts (asserted)."""

from __future__ import annotations

import pytest

from tephra.apps.ppo.main import parse_config
from tephra.core.errors import ConfigError

CASES = [
    # typo'd registry names, each naming the closest registered one
    (["algorithm.adv_estimator=grpoo"],
     r"algorithm.adv_estimator='grpoo' is not a registered advantage estimator \(did you mean 'grpo'\?\)"),
    (["actor.objective.policy_loss=vanila"],
     r"actor.objective: .*policy_loss='vanila' is not registered \(did you mean 'vanilla'\?\)"),
    (["actor.objective.loss_agg_mode=seq-mean-token-sum-nrm"],
     r"loss_agg_mode='seq-mean-token-sum-nrm' is not registered \(did you mean 'seq-mean-token-sum-norm'\?\)"),
    (["actor.objective.kl_loss_type=k4"], r"kl_loss_type='k4' is not registered"),
    (["algorithm.kl_in_reward.estimator=k9"], r"algorithm.kl_in_reward.estimator='k9' is not a registered KL estimator"),
    (["rollout.backend=vlm"], r"rollout.backend='vlm' is not a registered rollout backend \(did you mean 'vllm'\?\)"),
    (["rollout.agent_loop=tool_agnt", "rollout.tools_file=python"],
     r"rollout.agent_loop='tool_agnt' is not a registered agent loop"),
    (["trainer.trackers=[wandbb]"], r"trainer.trackers='wandbb' is not a registered tracker \(did you mean 'wandb'\?\)"),
    (["actor.engine=deepspeed"], r"actor: engine='deepspeed' is not an installed engine backend"),
    # estimators whose needs the batch cannot meet
    (["algorithm.adv_estimator=passk_expectation", "algorithm.advantage.passk_k=8"],
     r"passk_k=8 needs at least k samples per prompt; batch.samples_per_prompt=4"),
    (["algorithm.adv_estimator=rloo", "batch.samples_per_prompt=1"],
     r"'rloo' compares samples of one prompt; batch.samples_per_prompt=1 must be >= 2"),
    (["algorithm.adv_estimator=remax", "rollout.agent_loop=tool_agent", "rollout.tools_file=python"],
     r"'remax' takes the greedy response's reward as the baseline.*not supported with rollout.agent_loop"),
    (["actor.objective.loss_agg_mode=seq-mean-token-sum-norm"],
     r"loss_agg_norm_constant=None: loss_agg_mode 'seq-mean-token-sum-norm' needs a positive constant"),
    # unknown keys and wrong types
    (["actor.optimizer.lrr=1e-4"], r"unknown config key 'actor.optimizer.lrr'; did you mean 'actor.optimizer.lr'"),
    (["batch.prompts_per_step=four"], r"batch.prompts_per_step='four' must be an integer"),
    (["actor.lora.rank=-1"], r"lora.rank=-1 must be >= 0"),
    (["algorithm.advantage.gamma=1.5"], r"advantage.gamma=1.5 must be in \[0.0, 1.0\]"),
    # parallel sizes
    (["resources.world_size=3", "actor.engine=megatron", "actor.parallel.tensor=2"],
     r"world size 3 is not divisible by parallel.tensor \* parallel.pipeline \* parallel.context = 2"),
    (["batch.prompts_per_step=3", "resources.world_size=2"],
     r"prompts_per_step=3 must be a multiple of the data-parallel size 2"),
    (["resources.ref.ranks=1"], r"resources.ref.ranks=1, but nothing uses a reference: set "
     r"actor.objective.use_kl_loss=true"),
    (["resources.critic.ranks=1"], r"resources.critic.ranks=1, but algorithm.adv_estimator='grpo' "
     r"uses no critic; set resources.critic.ranks=0"),
    (["algorithm.adv_estimator=gae", "resources.critic.ranks=3"],
     r"resources.critic.ranks=3 gives 3 data-parallel ranks, which the step's 8 samples"),
    (["resources.critic.cpus_per_rank=-1"], r"resources.<role>: .*must be >= 0"),
    (["rollout.backend=vllm", "rollout.vllm.tensor_parallel_size=2", "resources.world_size=3",
      "batch.prompts_per_step=3", "batch.samples_per_prompt=2"],
     r"rollout.vllm.tensor_parallel_size=2 does not divide resources.world_size=3: each "
     r"rollout engine takes that many consecutive ranks"),
    # options a backend does not support, refused by the backend before anything starts
    (["actor.engine=megatron", "actor.lora.rank=8"],
     r"actor.engine='megatron': lora.rank > 0 is not supported by engine-megatron"),
    (["actor.engine=megatron", "actor.precision.reduce_dtype=bfloat16"],
     r"actor.engine='megatron': precision.reduce_dtype='bfloat16': engine-megatron reduces"),
    (["actor.parallel.tensor=2", "resources.world_size=2", "batch.prompts_per_step=2"],
     r"actor.engine='fsdp': parallel.tensor=2: engine=fsdp has data and sequence"),
    (["actor.engine=megatron", "model.attn_implementation=eager"],
     r"actor.engine='megatron': model.attn_implementation='eager': engine-megatron runs"),
    # server rollout settings
    (["rollout.backend=vllm", "rollout.vllm.sleep_mode=true"],
     r"rollout.vllm.sleep_mode=true: vLLM's CPU build refuses to start with sleep mode"),
    (["rollout.backend=vllm", "rollout.vllm.weight_sync=nfs"], r"weight_sync='nfs': expected 'memory'"),
    # training modes
    (["trainer.mode=async"], r"trainer.mode=async streams samples from rollout replicas.*"
     r"resources.rollout.replicas >= 1"),
    (["trainer.mode=async", "resources.rollout.replicas=1", "-p", "dapo"],
     r"trainer.mode=async: algorithm.dynamic_sampling"),
    (["trainer.mode=asynch"], r"trainer.mode='asynch': choose one of"),
    (["trainer.mode=async", "resources.rollout.replicas=1", "trainer.async_in_flight=1"],
     r"async_in_flight x resources.rollout.replicas x trainer.async_groups_per_request = "
     r"1 x 1 x 1 = 1 groups .* fewer than the batch.prompts_per_step \+ "
     r"async_groups_per_request - 1 = 2"),
    (["trainer.mode=async", "resources.rollout.replicas=1", "trainer.async_in_flight=1",
      "trainer.async_groups_per_request=2"], r"1 x 1 x 2 = 2 groups .* - 1 = 3 a step needs"),
    (["trainer.async_groups_per_request=0"], r"trainer.async_groups_per_request=0 >= 1"),
    (["trainer.mode=one_step_off", "trainer.partial_rollout=true"],
     r"trainer.partial_rollout=true .* needs trainer.mode=async \(now 'one_step_off'\)"),
    (["trainer.mode=async", "resources.rollout.replicas=1", "rollout.backend=nopause",
      "trainer.partial_rollout=true"],
     r"trainer.partial_rollout=true: rollout.backend='nopause' cannot interrupt a generation in "
     r"flight .* use one of \['hf', 'sglang', 'vllm'\] or set trainer.partial_rollout=false"),
]


class NoPauseRollout:
    """A registered backend without `paused()`: partial rollout must be refused for it."""

    def __init__(self, config) -> None:
        raise AssertionError("the config check must not build the backend")


@pytest.fixture(autouse=True)
def nopause_backend(monkeypatch):
    import tephra.rollout.backends  # noqa: F401  (the built-ins first)
    from tephra.rollout.base import ROLLOUT_BACKENDS

    monkeypatch.setitem(ROLLOUT_BACKENDS._items, "nopause", NoPauseRollout)


@pytest.mark.parametrize("overrides, message", CASES, ids=[c[0][-1] for c in CASES])
def test_bad_option_is_one_clear_error_before_ray(overrides, message):
    import ray

    with pytest.raises(ConfigError, match=message):
        parse_config(["-p", "smoke", *overrides])
    assert not ray.is_initialized()


@pytest.mark.parametrize("backend", ["hf", "vllm", "sglang"])
def test_partial_rollout_is_accepted_with_every_built_in_backend(backend):
    import ray

    cfg = parse_config(["-p", "smoke", "trainer.mode=async", "resources.rollout.replicas=1",
                        "trainer.partial_rollout=true", f"rollout.backend={backend}"])
    assert cfg.trainer.partial_rollout and cfg.rollout.backend == backend
    assert not ray.is_initialized()
