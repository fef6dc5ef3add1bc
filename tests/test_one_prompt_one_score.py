"""One prompt type and one score type through a worker's generation part: the `Prompt` the
trainer sends is what the episode runs on and what the scorer reads, and the scorer's
`RewardResult` is what `collect_scores` hands back, unchanged, with the scoring seconds beside
it (merged over ranks as the dispatch does)."""

from __future__ import annotations

import pytest

from tephra.apps.ppo.main import parse_config
from tephra.controller.cluster.dispatch import collect
from tephra.controller.run.models import resolve_model_path
from tephra.controller.samples import Prompt, RewardResult, Scores
from tephra.controller.step.rounds import Prompts
from tephra.controller.workers.generation import Generator
from tephra.rollout.base import SamplingParams
from tephra.rollout.testing import ScriptedRollout

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise ValueError("no number")
    return {"score": float(solution_str), "bonus": extra_info["bonus"], "truth": float(ground_truth)}
"""


def test_the_scorers_result_is_what_the_worker_hands_back(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "rollout.agent_loop=single_turn",
            f"reward.custom_function_path={reward}",
            "reward.clip=[-1,1]",
        ]
    )
    model = resolve_model_path("tiny")
    gen = Generator(cfg, model, None, rollout=None)
    script = {"a0-0": "0.5", "a0-1": "3", "a1-0": "boom", "a1-1": "-0.25"}
    gen.rollout = ScriptedRollout(gen.tokenizer(), lambda s, k: script[s])
    rows = [
        Prompt([{"role": "user", "content": "q0"}], "my_task", "7", {"bonus": 0.5}),
        Prompt([{"role": "user", "content": "q1"}], "my_task", "8", {"bonus": 2.0}),
    ]
    prompts = Prompts([[1, 2], [3, 4, 5]], rows)
    items = [prompts.item(0, "a0"), prompts.item(1, "a1")]
    assert rows[0].prompt_ids is None and items[1].prompt_ids == [3, 4, 5]  # the row is kept
    try:
        samples = gen.generate(items, SamplingParams(n=2, temperature=0.0, max_tokens=8))
        scores = gen.collect_scores()
    finally:
        gen.close()
    assert [s.text for s in samples] == ["0.5", "3", "boom", "-0.25"]
    assert [s.prompt_ids for s in samples] == [[1, 2], [1, 2], [3, 4, 5], [3, 4, 5]]
    # the episode's samples hold what it added, not the prompt's data (the prompt holds that)
    assert all("bonus" not in s.extra_info for s in samples)
    assert isinstance(scores, Scores) and scores.seconds > 0.0
    want = [
        RewardResult(0.5, {"bonus": 0.5, "truth": 7.0}),
        RewardResult(1.0, {"bonus": 0.5, "truth": 7.0}, clipped=True),  # 3 clipped to 1
        RewardResult(0.0, error="ValueError: no number"),
        RewardResult(-0.25, {"bonus": 2.0, "truth": 8.0}),
    ]
    assert scores.rewards == want


def test_ranks_scores_merge_in_rank_order_with_the_slowest_ranks_seconds():
    a, b, c = RewardResult(1.0), RewardResult(0.0, error="E: x"), RewardResult(0.5, {"k": 1.0})
    merged = collect([Scores([a, b], 2.0), Scores([], 9.0), Scores([c], 3.0)])
    # the seconds of ranks that scored samples (an empty share's do not count), the largest
    assert merged == Scores([a, b, c], 3.0)
    assert collect([Scores([], 4.0)]) == Scores([], 0.0)
    assert collect([[a], [b, c]]) == [a, b, c]  # lists as before


@pytest.mark.parametrize("images", [False, True])
def test_a_prompt_set_names_and_tokenises_its_items(images):
    import torch

    from tephra.rollout.multimodal import MultimodalInputs

    mm = MultimodalInputs(torch.zeros(4, 8), torch.tensor([[1, 2, 2]])) if images else None
    row = Prompt([{"role": "user", "content": "q"}], "d", "1", tool_kwargs={"t": {"x": 1}})
    prompts = Prompts([[9, 8]], [row], [mm] if images else None)
    item = prompts.item(0, "step3-0")
    assert (item.sample_id, item.prompt_ids, item.multimodal) == ("step3-0", [9, 8], mm)
    assert (item.messages, item.tool_kwargs, item.data_source) == (
        row.messages,
        {"t": {"x": 1}},
        "d",
    )
