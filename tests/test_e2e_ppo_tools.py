"""Multi-turn GRPO with tools in the PPO app: the smoke_tools preset end to end through Ray
(2 steps, the sandboxed python tool), and, in one process, the worker's agent rollout with a
scripted first turn that calls the real python tool: masks, metrics and the loss's gradient
checked against hand-written expectations."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.launch.ppo import BUNDLED_TOOLS, resolve_tools_file
from tephra.controller.launch.testing import run_and_read
from tephra.controller.run.models import resolve_model_path
from tephra.controller.samples import Prompt, Sample, agent_metrics, samples_to_batch
from tephra.controller.step.advantages import outcome_token_rewards
from tephra.controller.testing import SMOKE_REWARD
from tephra.controller.workers.generation import run_items
from tephra.core.errors import ConfigError
from tephra.rollout.base import Rollout

AGENT_KEYS = (
    "agent/turns_mean",
    "agent/tool_calls_mean",
    "agent/tool_errors_mean",
    "agent/generated_tokens",
    "agent/tool_tokens",
)


@pytest.mark.multiproc
def test_smoke_tools_preset_runs_multiturn_grpo_on_two_ranks(
    tmp_path, grpo_step_reference, smoke_score
):
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)
    # two ranks: each runs the agent loop on its share of prompts, FSDP over gloo trains
    cfg = parse_config(
        [
            "-p",
            "smoke_tools",
            f"reward.custom_function_path={reward}",
            "trainer.val_after=true",
            "resources.world_size=2",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    summary, trained = run_and_read(run, cfg)
    # held-out greedy, through the agent loop: each score is the smoke reward on the
    # trajectory's text, the accuracy the share of full scores
    gens = tmp_path / "run" / "generations"
    val = [json.loads(x) for x in (gens / "val_step2.jsonl").read_text().splitlines()]
    assert [r["prompt_index"] for r in val] == list(range(cfg.data.val_size))
    assert [r["score"] for r in val] == [smoke_score(r["response"]) for r in val]
    assert summary["accuracy_after"] == pytest.approx(sum(r["score"] >= 1 for r in val) / len(val))
    samples = cfg.batch.samples_per_step
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny", 0))
    for r, rows in trained:
        # the agent metrics recomputed from the dumped trajectories
        want = _agent_metrics_of_rows(rows, tokenizer)
        for key in AGENT_KEYS[:2] + AGENT_KEYS[3:]:
            assert r[key] == pytest.approx(want[key], abs=1e-9), key
        assert 1 <= r["agent/turns_mean"] <= cfg.rollout.agent.max_turns
        assert 0 <= r["agent/tool_errors_mean"] <= r["agent/tool_calls_mean"]
        # the loss trained exactly the model's own tokens: tool tokens are masked out
        assert r["perf/trained_tokens"] == r["agent/generated_tokens"]
        # with no tool call no tool turn was appended; each call appends a tool turn
        assert (r["agent/tool_tokens"] > 0) == (r["agent/tool_calls_mean"] > 0)
        assert r["agent/generated_tokens"] <= samples * cfg.rollout.agent.max_response_tokens
        all_flat = r.get("actor/skipped_flat_groups") == cfg.batch.prompts_per_step
        # the logged reward mean and the advantages are GRPO's on the dumped samples' scores;
        # step 1 (on-policy, the initial weights) also its loss and gradient norm over the
        # model's tokens (mask 1), recomputed in plain transformers in one process: the two
        # ranks' gradients add up to it (the rows flat-group skipping leaves out count in the
        # normaliser); a step whose groups all scored flat trains nothing, its gradient is 0
        assert [x["score"] for x in rows] == [smoke_score(x["response"]) for x in rows]
        want = grpo_step_reference(resolve_model_path("tiny", 0) if r["step"] == 1 else None, rows)
        # every step trains on its own samples (one mini-batch, ratio 1): its loss is
        # -sum_i A_i |y_i| / N of its dumped rows, the weights moved or not
        assert r["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5)
        if r["step"] == 1:
            assert r["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        elif all_flat:
            assert r["actor/grad_norm"] == 0.0
        assert [x["advantage"] for x in rows] == pytest.approx(want["advantages"], abs=1e-5)
        assert r["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6)
        assert all_flat == all(a == 0 for a in want["advantages"])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


def _agent_metrics_of_rows(rows: list[dict], tokenizer) -> dict[str, float]:
    """A step's agent metrics written out from its dumped trajectories (none dropped):
    a turn is a run of model tokens (mask 1), each followed by its tool turn (mask 0) unless
    it was the last; a tool call is a complete `<tool_call>...</tool_call>` block in the text
    of a turn the environment stepped on (all but a last turn cut by the length limit);
    generated tokens are the mask's ones, tool tokens the rest of the response."""
    turns = calls = generated = total = 0
    for row in rows:
        assert row["finish_reason"] not in ("tool_timeout", "turn_timeout", "trajectory_timeout")
        ids, mask = row["response_ids"], row["response_mask"]
        runs: list[list[int]] = []
        for k, (t, m) in enumerate(zip(ids, mask, strict=True)):
            if m and (k == 0 or not mask[k - 1]):
                runs.append([])
            if m:
                runs[-1].append(t)
        if row["finish_reason"] == "length" and mask and mask[-1]:
            stepped = runs[:-1]
        else:
            stepped = runs
        turns += len(runs)
        calls += sum(
            len(re.findall(r"<tool_call>.*?</tool_call>", tokenizer.decode(run), re.DOTALL))
            for run in stepped
        )
        generated += sum(mask)
        total += len(ids)
    return {
        "agent/turns_mean": turns / len(rows),
        "agent/tool_calls_mean": calls / len(rows),
        "agent/generated_tokens": float(generated),
        "agent/tool_tokens": float(total - generated),
    }


class FirstTurnScripted(Rollout):
    """Turn 0 of every trajectory is `text` + EOS (a tool call the random model would not
    write); later turns are the real tiny model's generations."""

    def __init__(self, tokenizer, text: str, model: Rollout) -> None:
        self.tokenizer, self.model, self.config = tokenizer, model, model.config
        self.scripted = list(tokenizer.encode(text, add_special_tokens=False)) + [
            tokenizer.eos_token_id
        ]
        self.turns: dict[str, int] = {}
        self.generated: dict[str, list[list[int]]] = {}

    async def agenerate(self, prompt_ids, sampling, session_id=None):
        turn = self.turns.get(session_id, 0)
        self.turns[session_id] = turn + 1
        if turn == 0:
            gen = Sample(
                response_ids=list(self.scripted),
                log_probs=[-0.5] * len(self.scripted),
                finish_reason="stop",
            )
        else:
            gen = await self.model.agenerate(prompt_ids, sampling, session_id)
        self.generated.setdefault(session_id, []).append(list(gen.response_ids))
        return gen

    def generate(self, prompts, sampling):
        raise NotImplementedError("this scripted model serves agenerate only")

    def record_routes(self, rows):
        return self.model.record_routes(rows)

    def update_weights(self, named_tensors):
        self.model.update_weights(named_tensors)

    def sleep(self):
        pass

    def wake_up(self):
        pass

    def close(self):
        self.model.close()


def test_worker_agent_rollout_masks_tool_tokens_and_loss_ignores_them(tmp_path):
    from transformers import AutoTokenizer

    from tephra.algos import ActorObjective, compute_advantages
    from tephra.episodes.agent import AgentLoopConfig
    from tephra.episodes.registry import EPISODES
    from tephra.episodes.tools import load_tools
    from tephra.rollout import RolloutConfig, SamplingParams, get_rollout
    from tephra.rollout.testing import build_tiny_model

    tiny = build_tiny_model(tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(tiny.path)
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    model = get_rollout("hf", RolloutConfig(model_path=tiny.path, max_model_len=256))
    scripted = FirstTurnScripted(tok, call, model)
    sampling = SamplingParams(
        n=1, temperature=1.0, max_tokens=8, seed=3, stop_token_ids=(tok.eos_token_id,)
    )
    episode = EPISODES.get("tool_agent")(
        tok,
        AgentLoopConfig(max_turns=2, max_response_tokens=96),
        load_tools(resolve_tools_file("python")),
    )
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    prompt_ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    items = [
        Prompt(messages, "test", "42", sample_id=f"p0-{k}", prompt_ids=prompt_ids) for k in range(2)
    ]
    try:
        samples = run_items(episode, scripted, items, sampling)
    finally:
        scripted.close()

    # the tool turn, written by hand from the tiny model's ChatML template
    tool_turn = "\n<|im_start|>tool\n42\n<|im_end|>\n<|im_start|>assistant\n"
    for s in samples:
        assert (s.num_turns, s.tool_calls, s.tool_errors) == (2, 1, 0)
        first, second = scripted.generated[s.sample_id]
        assert s.response_ids == first + tok.encode(tool_turn, add_special_tokens=False) + second
        n_tool = len(s.response_ids) - len(first) - len(second)
        assert s.response_mask == [1] * len(first) + [0] * n_tool + [1] * len(second)
        assert tok.decode(second[:-1] if s.finish_reason == "stop" else second) == s.text

    batch = samples_to_batch(samples, tok.pad_token_id, n=2, multi_turn=True)
    assert batch["prompt_index"].tolist() == [0, 0]
    assert batch["tool_calls"].tolist() == [1, 1]
    metrics = agent_metrics(samples)
    assert metrics["agent/tool_calls_mean"] == 1.0 and metrics["agent/turns_mean"] == 2.0
    assert metrics["agent/tool_tokens"] == 2 * n_tool
    assert metrics["agent/generated_tokens"] == int(batch["response_mask"].sum())

    # The policy loss of the app (GRPO advantages, the actor objective) has zero gradient on
    # tool tokens and a nonzero one on the model's tokens.
    mask = batch["response_mask"]
    rewards = outcome_token_rewards(torch.tensor([0.0, 1.0]), mask)
    adv, _ = compute_advantages(
        "grpo", token_rewards=rewards, response_mask=mask, group_ids=batch["prompt_index"]
    )
    log_probs = batch["rollout_log_probs"].clone().requires_grad_(True)
    tokens = torch.full((2,), float(mask.sum()))
    loss, _ = ActorObjective()(
        {"log_probs": log_probs},
        {
            "old_log_probs": batch["rollout_log_probs"],
            "advantages": adv.float(),
            "response_mask": mask,
            "global_token_count": tokens,
            "global_seq_count": torch.full((2,), 2.0),
        },
    )
    loss.backward()
    tool_positions = (batch["attention_mask"] == 1) & (mask == 0)
    tool_positions[:, : len(prompt_ids)] = False  # [B, P + R]: the prompt fills the first P
    assert int(tool_positions.sum()) == 2 * n_tool
    assert torch.all(log_probs.grad[tool_positions] == 0)
    assert torch.all(log_probs.grad[mask == 1] != 0)


def test_agent_config_errors():
    with pytest.raises(
        ConfigError, match=r"rollout.agent_loop='tool_agent' needs rollout.tools_file"
    ):
        parse_config(["-p", "smoke_tools", "rollout.tools_file=null"])
    with pytest.raises(
        ConfigError, match=r"rollout.agent_loop='tool_agnt' is not a registered agent loop"
    ):
        parse_config(["-p", "smoke_tools", "rollout.agent_loop=tool_agnt"])
    with pytest.raises(
        ConfigError,
        match=r"96 \+ 500 = 596 tokens, more than actor.micro_batch.max_tokens_per_microbatch=512",
    ):
        parse_config(["-p", "smoke_tools", "rollout.agent.max_response_tokens=500"])
    with pytest.raises(ConfigError, match=r"rollout.tools_file='nope': no such file.*\['python'\]"):
        resolve_tools_file("nope")
    assert resolve_tools_file("python") == str(BUNDLED_TOOLS / "python.yaml")


def test_agent_rollout_records_the_routes_of_whole_episodes(tmp_path):
    """Routing replay with an agent loop (`actor.moe.routing_replay=rollout`): each episode's
    routes cover its prompt, the scripted tool call, the tool's output and the second turn,
    and equal transformers' routers over that whole sequence; the batch lays them out like
    its tokens (-1 on padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tephra.controller.workers.generation import Generator
    from tephra.rollout import RolloutConfig, SamplingParams, get_rollout
    from tephra.rollout.testing import build_tiny_model

    tiny = build_tiny_model(tmp_path / "moe", model_type="qwen2_moe")
    tok = AutoTokenizer.from_pretrained(tiny.path)
    cfg = parse_config(
        ["-p", "smoke_tools", f"model.path={tiny.path}", "actor.moe.routing_replay=rollout"]
    )
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    model = get_rollout("hf", RolloutConfig(model_path=tiny.path, max_model_len=256))
    scripted = FirstTurnScripted(tok, call, model)
    gen = Generator(cfg, tiny.path, resolve_tools_file("python"), scripted)
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    prompt_ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    sampling = SamplingParams(
        n=2, temperature=1.0, max_tokens=8, seed=3, stop_token_ids=(tok.eos_token_id,)
    )
    try:
        samples = gen.generate(
            [Prompt(messages, "test", "42", sample_id="p0", prompt_ids=prompt_ids)],
            sampling,
            score=False,
        )
    finally:
        scripted.close()

    reference = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32).eval()
    gates = [layer.mlp.gate for layer in reference.model.layers]
    for s in samples:
        assert s.tool_calls == 1 and s.num_turns >= 2  # the tool's output is inside the row
        ids = s.prompt_ids + s.response_ids
        seen: list[torch.Tensor] = []
        hooks = [
            g.register_forward_hook(lambda m, a, o, seen=seen: seen.append(o[2])) for g in gates
        ]
        with torch.no_grad():
            reference(input_ids=torch.tensor([ids]))
        for h in hooks:
            h.remove()
        want = torch.stack(seen, dim=1)  # [tokens, layers, k]
        assert s.routed_experts is not None and s.routed_experts.shape == want.shape
        assert torch.equal(s.routed_experts.sort(-1).values, want.sort(-1).values)
    batch = samples_to_batch(samples, tok.pad_token_id, n=2, multi_turn=True)
    routes, attn = batch["routed_experts"], batch["attention_mask"].bool()
    assert (routes[~attn] == -1).all()
    for i, s in enumerate(samples):
        assert torch.equal(routes[i][attn[i]], s.routed_experts)
