"""An environment's per-turn rewards reach the trainer's token rewards on the last generated
token of their own turn (not summed onto the trajectory's last token), checked against a hand
placement from the batch's response mask: turn k's reward at the end of the k-th run of
model tokens, the score's remainder (length shaping) on the last one."""

from __future__ import annotations

import asyncio

import torch

from tephra.controller.samples import samples_to_batch
from tephra.controller.step.advantages import outcome_token_rewards
from tephra.episodes.agent import TOOL_CHAT_TEMPLATE, AgentLoopConfig, Prompt
from tephra.episodes.registry import EPISODES
from tephra.rollout.base import SamplingParams
from tephra.rollout.testing import ScriptedRollout, build_tiny_tokenizer

COUNTER_ENV = '''
from tephra.episodes.environments import Environment, StepResult


class Counter(Environment):
    """Rewards each turn with 0.5 per word; the user says "again" until 3 turns."""

    async def reset(self, item):
        self.left = 3
        return list(item.messages)

    async def step(self, action):
        self.left -= 1
        reward = 0.5 * len(action.split())
        if self.left == 0:
            return StepResult(reward=reward, done=True)
        return StepResult([{"role": "user", "content": "again"}], reward=reward)
'''


def run_ends(mask: list[int]) -> list[int]:
    """Index of the last token of each run of ones."""
    return [t for t in range(len(mask)) if mask[t] and (t + 1 == len(mask) or not mask[t + 1])]


def test_per_turn_rewards_land_on_their_turns_tokens(tmp_path):
    path = tmp_path / "counter_env.py"
    path.write_text(COUNTER_ENV)
    tok = build_tiny_tokenizer()
    tok.chat_template = TOOL_CHAT_TEMPLATE
    answers = {"a": ["one", "one two", "one two three"], "b": ["x y", "z", "w w w w"]}
    model = ScriptedRollout(tok, lambda s, k: answers[s][k])
    loop = EPISODES.get("environment")(
        tok, AgentLoopConfig(max_turns=5, environment=f"{path}:Counter")
    )
    items = [
        Prompt([{"role": "user", "content": "Go."}], sample_id="a"),
        Prompt([{"role": "user", "content": "A longer prompt: go on."}], sample_id="b"),
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    samples = [asyncio.run(loop.run(model, item, greedy)) for item in items]
    assert [s.extra_info["turn_rewards"] for s in samples] == [[0.5, 1.0, 1.5], [1.0, 0.5, 2.0]]
    shaping = torch.tensor([-0.25, 0.0])
    scores = torch.tensor([float(s.env_reward) for s in samples]) + shaping
    batch = samples_to_batch(samples, tok.pad_token_id, n=2, multi_turn=True)
    mask = batch["response_mask"]
    got = outcome_token_rewards(scores, mask, samples)

    want = torch.zeros(mask.shape)
    for i, s in enumerate(samples):
        ends = run_ends(mask[i].tolist())
        assert len(ends) == 3  # three model turns, separated by the user's "again"
        for reward, end in zip(s.extra_info["turn_rewards"], ends, strict=True):
            want[i, end] += reward
        want[i, ends[-1]] += float(shaping[i])
    torch.testing.assert_close(got, want)
    # the whole score is still there, and without the samples it sits on the last token
    torch.testing.assert_close(got.sum(-1), scores)
    plain = outcome_token_rewards(scores, mask)
    assert plain[0].nonzero().numel() == 1 and plain.sum(-1).tolist() == scores.tolist()
