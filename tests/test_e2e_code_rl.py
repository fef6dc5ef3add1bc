"""Code RL: the shipped problems' tests accept a reference solution written independently for
each (run by the sandboxed code scorer) and reject a wrong one; the code_rl preset trains two
steps through apps/ppo; the eval app's code preset reports pass@k on the held-out problems."""

from __future__ import annotations

import json

import pytest

from tephra.controller.data.code_problems import PROBLEMS, TRAIN, code_problem_records
from tephra.controller.launch.testing import run_and_read
from tephra.episodes.rewards import REWARD_SCORERS

SOLUTIONS = [
    "a, b = map(int, input().split())\nprint(a + b)",
    "print(input()[::-1])",
    "import math\nprint(math.factorial(int(input())))",
    "print('even' if int(input()) % 2 == 0 else 'odd')",
    "print(max(map(int, input().split())))",
    "print(sum(c in 'aeiouAEIOU' for c in input()))",
    "print(sum(int(d) for d in input().strip().lstrip('-')))",
    "import math\na, b = map(int, input().split())\nprint(math.gcd(a, b))",
    "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)",
    "print(' '.join(map(str, sorted(map(int, input().split())))))",
    "print(len(input().split()))",
    "n = int(input())\nprint(' '.join(str(i * i) for i in range(1, n + 1)))",
    "n = int(input())\nprint('yes' if all(n % d for d in range(2, int(n**0.5) + 1)) else 'no')",
    "w = input().strip()\nprint('yes' if w == w[::-1] else 'no')",
    "a, b = map(int, input().split())\nprint(abs(a - b))",
    "print(len(set(input().split())))",
    "print(sum(map(int, input().split())))",
    "print(input().upper())",
    "print(' '.join(map(str, range(1, int(input()) + 1))))",
    "print(min(map(int, input().split())))",
    "a, b = map(int, input().split())\nprint(a**b)",
    "print(input().count('a'))",
    "print(sum(int(x) % 2 == 0 for x in input().split()))",
    "print(bin(int(input()))[2:])",
]


def fenced(program: str) -> str:
    return f"Here it is.\n```python\n{program}\n```"


def test_every_shipped_problem_accepts_its_reference_and_rejects_a_wrong_program():
    score = REWARD_SCORERS.get("code")
    records = code_problem_records("train") + code_problem_records("val")
    assert len(records) == len(PROBLEMS) == len(SOLUTIONS) and TRAIN == 16
    for record, program in zip(records, SOLUTIONS):
        result = score("code", fenced(program), record.ground_truth, record.extra_info)
        assert result["score"] == 1.0, (record.messages[0]["content"], result)
    wrong = score("code", fenced("print(0)"), records[0].ground_truth, None)
    assert wrong["score"] == pytest.approx(1 / 3)  # only "-4 4" -> 0 passes
    assert score("code", "no code here", records[0].ground_truth, None)["score"] == 0.0


@pytest.mark.multiproc
def test_code_rl_preset_trains_two_steps(tmp_path):
    from tephra.apps.ppo.main import parse_config, run

    cfg = parse_config(
        [
            "-p",
            "code_rl",
            "model.path=tiny",
            "data.max_prompt_tokens=384",
            "rollout.dtype=float32",
            "rollout.max_tokens=16",
            "batch.prompts_per_step=2",
            "batch.samples_per_prompt=2",
            "trainer.steps=2",
            "trainer.val_every=0",
            "trainer.val_before=false",
            "trainer.progress_bar=false",
            "trainer.trackers=[jsonl]",
            "trainer.dump_generations=1",
            "resources.cpus_per_rank=1",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    summary, trained = run_and_read(run, cfg)
    for r, rows in trained:
        # the code scorer judged each response (a random model writes no ```python block)
        expected = [
            REWARD_SCORERS.get("code")("code", row["answer"], _truth(row), None)["score"]
            for row in rows
        ]
        assert [row["score"] for row in rows] == pytest.approx(expected)
        assert r["reward/mean"] == pytest.approx(sum(expected) / len(expected))


def _truth(row: dict) -> dict:
    """The ground truth of a dumped sample's problem, found by its prompt text."""
    for record in code_problem_records("train"):
        if record.messages[0]["content"] in row["prompt"]:
            return record.ground_truth
    raise AssertionError(f"no shipped problem matches {row['prompt'][:80]!r}")


def test_eval_app_reports_pass_at_k_on_the_held_out_problems(tmp_path):
    from tephra.apps.eval.config import parse_config
    from tephra.apps.eval.main import run
    from tephra.controller.run.evaluation import pass_at_k

    results = run(
        parse_config(
            [
                "-p",
                "code",
                "model.path=tiny",
                "data.max_prompt_tokens=384",
                "rollout.max_tokens=16",
                f"out_dir={tmp_path}",
            ]
        )
    )
    summary = results["tiny"]["summary"]["all"]
    assert summary["prompts"] == 8
    rows = [json.loads(x) for x in (tmp_path / "generations_tiny.jsonl").read_text().splitlines()]
    by_prompt: dict[int, list[bool]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_index"], []).append(r["score"] >= 1.0)
    for k in (1, 2, 4):
        expected = sum(pass_at_k(4, sum(c), k) for c in by_prompt.values()) / 8
        assert summary[f"pass@{k}"] == pytest.approx(expected)
