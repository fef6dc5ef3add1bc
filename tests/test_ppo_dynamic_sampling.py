"""DAPO in the PPO app: which samples a step trains on under dynamic sampling, and the overlong
shaping added to their rewards, against hand-built expectations (no Ray: the worker group is
a table of canned responses, since the logic under test is the trainer's)."""

from __future__ import annotations

import pytest
import torch

from tephra.apps.ppo.main import parse_config
from tephra.controller.data.prompts import PromptLoader
from tephra.controller.loop.trainer import Trainer
from tephra.controller.samples import Prompt, RewardResult, Sample, Scores
from tephra.controller.step.advantages import length_shaping
from tephra.controller.step.rounds import Prompts
from tephra.core.errors import ConfigError

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.startswith("R") else 0.0
"""
N = 4  # samples per prompt
KINDS = ("all wrong", "all right", "mixed")


def kind(prompt: int) -> str:
    return KINDS[prompt % 3]


class CharTokenizer:
    eos_token_id, pad_token_id = 0, 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class CannedWorkers:
    """Prompt i answers per its kind; a mixed group is right on its first half. Response
    lengths are 2, 4, 6, 8 tokens by sample position. Scores: 1 for an answer starting with R
    (what the workers' scorer would give with REWARD)."""

    world_size = dp_size = 1

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.last: list[Sample] = []

    def generate(self, items, sampling):
        self.calls.append([i.prompt_ids[0] for i in items])
        out = []
        for item in items:
            p = item.prompt_ids
            for k in range(sampling.n):
                right = {"all wrong": False, "all right": True, "mixed": k < sampling.n // 2}
                ids = [ord("R" if right[kind(p[0])] else "W")] + [ord("x")] * (2 * k + 1)
                out.append(
                    Sample(
                        prompt_ids=p,
                        response_ids=ids,
                        response_mask=[1] * len(ids),
                        log_probs=[0.0] * len(ids),
                        finish_reason="stop",
                        text="".join(map(chr, ids)),
                    )
                )
        self.last = out
        return out

    def collect_scores(self):
        return Scores(
            [RewardResult(1.0 if s.text.startswith("R") else 0.0) for s in self.last], 0.0
        )


def _trainer(tmp_path, *overrides, prompts=30):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    cfg = parse_config(
        [
            "-p",
            "smoke",
            f"reward.custom_function_path={reward}",
            f"batch.samples_per_prompt={N}",
            "batch.prompts_per_step=3",
            *overrides,
        ]
    )
    train = Prompts(
        [[i] for i in range(prompts)],
        [Prompt([{"role": "user", "content": str(i)}], "test", "R") for i in range(prompts)],
    )
    wg = CannedWorkers()
    return Trainer(cfg, wg, CharTokenizer(), train, Prompts([], []), tmp_path, 1, 0.0), wg


def _expected(order_seed_prompts, want, max_rounds):
    """Walk the loader's prompt order by hand: keep mixed groups until `want`, then fill
    with the latest flat ones."""
    loader = PromptLoader(order_seed_prompts, want, 0)
    rounds = [loader.next_indices() for _ in range(max_rounds)]
    kept, used = [], 0
    for r, idx in enumerate(rounds):
        for p in idx:
            if kind(p) == "mixed" and len(kept) < want:
                kept.append(p)
        used = r + 1
        if len(kept) == want:
            break
    filled = 0
    for idx in reversed(rounds[:used]):
        for p in idx:
            if kind(p) != "mixed" and len(kept) + filled < want:
                filled += 1
    return rounds[:used], kept, filled


def test_dynamic_sampling_keeps_informative_groups(tmp_path):
    trainer, wg = _trainer(
        tmp_path, "algorithm.dynamic_sampling=true", "algorithm.max_gen_batches=5"
    )
    rounds_want, kept_want, filled_want = _expected(30, 3, 5)
    rounds = trainer.collect(0, scored=True)
    assert wg.calls == rounds_want
    assert filled_want == 0 and len(kept_want) == 3
    kept = [s.prompt_ids[0] for r in rounds for s in r.kept]
    assert kept == [p for p in kept_want for _ in range(N)]  # whole groups, in order
    # every kept group has both scores: its GRPO advantages are not all zero
    assert sorted(s.reward.score for r in rounds for s in r.kept) == [0.0] * 6 + [1.0] * 6


def test_dynamic_sampling_fills_a_short_batch_with_flat_groups(tmp_path):
    # one round only: the mixed groups of that round, then flat ones of the same round
    trainer, wg = _trainer(
        tmp_path, "algorithm.dynamic_sampling=true", "algorithm.max_gen_batches=1"
    )
    rounds = trainer.collect(0, scored=True)
    (idx,) = wg.calls
    rnd = rounds[0]
    mixed = [g for g, p in enumerate(idx) if kind(p) == "mixed"]
    assert len(mixed) < 3, "the canned order must leave this round short"
    assert rnd.kept_groups == list(range(3)) and rnd.filler == 3 - len(mixed)
    assert rnd.informative == len(mixed)


def test_without_dynamic_sampling_one_round_is_kept_whole(tmp_path):
    trainer, wg = _trainer(tmp_path)
    rounds = trainer.collect(0, scored=True)
    assert len(rounds) == 1 and len(wg.calls) == 1
    assert [s.prompt_ids[0] for s in rounds[0].kept] == [p for p in wg.calls[0] for _ in range(N)]


def test_overlong_shaping_by_hand(tmp_path):
    # smoke: rollout.max_tokens=8, buffer 4: lengths 2, 4 -> 0; 6 -> -0.5; 8 -> -1 (x 0.5)
    trainer, _ = _trainer(
        tmp_path, "algorithm.overlong_buffer=4", "algorithm.overlong_penalty_factor=0.5"
    )
    samples = trainer.collect(0, scored=True)[0].kept[:N]
    assert length_shaping(trainer.cfg, samples).tolist() == [0.0, 0.0, -0.25, -0.5]
    off, _ = _trainer(tmp_path)
    assert torch.equal(length_shaping(off.cfg, samples), torch.zeros(N))


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "algorithm.overlong_buffer=9",
            r"overlong_buffer=9 must be between 0 \(off\) and the "
            r"response budget rollout.max_tokens=8",
        ),
        ("algorithm.max_gen_batches=0", r"algorithm.max_gen_batches=0 must be >= 1"),
        ("algorithm.overlong_penalty_factor=-1", r"overlong_penalty_factor=-1.0 must be >= 0"),
    ],
)
def test_dapo_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(["-p", "smoke", override])
