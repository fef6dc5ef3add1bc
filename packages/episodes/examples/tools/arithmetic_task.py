"""Arithmetic with a Python tool: reasoning-gym `basic_arithmetic` problems (big operands, where
computing in Python beats mental arithmetic), rolled out with the `tool_agent` loop and the
sandboxed `python` tool of tools.yaml, scored by reasoning-gym's checker.

    uv run python packages/episodes/examples/tools/arithmetic_task.py --model PATH [--n 8]
    uv run python packages/episodes/examples/tools/arithmetic_task.py --tiny   # mechanics only

With --tiny a random tiny model is built: it never calls the tool, the script shows the plumbing.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
from pathlib import Path

import reasoning_gym
from transformers import AutoTokenizer

from tephra.episodes.agent import (
    TOOL_CHAT_TEMPLATE,
    AgentLoopConfig,
    Prompt,
)
from tephra.episodes.episode import run_episodes
from tephra.episodes.registry import EPISODES
from tephra.episodes.tools import load_tools
from tephra.rollout import RolloutConfig, SamplingParams, get_rollout
from tephra.rollout.testing import build_tiny_model

SYSTEM = (
    "Solve the problem. You can run Python with the `python` tool; print the values you need. "
    "End with 'Answer: <number>'."
)


def make_samples(n: int, seed: int) -> tuple[list[Prompt], object]:
    data = reasoning_gym.create_dataset("basic_arithmetic", size=n, seed=seed)
    samples = [
        Prompt(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item["question"]}],
            sample_id=f"arith-{i}",
            data_source="reasoning_gym/basic_arithmetic",
            ground_truth=item["answer"],
        )
        for i, item in enumerate(data)
    ]
    return samples, data


def final_answer(text: str) -> str:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.split("Answer:")[-1])
    return numbers[-1] if numbers else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local Hugging Face folder of an instruct model")
    parser.add_argument(
        "--tiny", action="store_true", help="use a random tiny model (plumbing only)"
    )
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tiny:
        args.model = build_tiny_model(tempfile.mkdtemp(prefix="tephra-tiny-")).path
    if not args.model:
        parser.error("give --model PATH or --tiny")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.tiny:
        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tools = load_tools(Path(__file__).with_name("tools.yaml"))
    rollout = get_rollout("hf", RolloutConfig(model_path=args.model, max_model_len=2048))
    loop = EPISODES.get("tool_agent")(
        tokenizer, AgentLoopConfig(max_turns=4, max_response_tokens=1024), tools
    )
    samples, data = make_samples(args.n, args.seed)
    trajectories = asyncio.run(
        run_episodes(loop, rollout, samples, SamplingParams(temperature=1.0, max_tokens=256))
    )
    rollout.close()
    # one trajectory per prompt, in the prompts' order
    scores = [
        float(data.score_answer(final_answer(t.messages[-1]["content"]), data[i]) == 1.0)
        for i, t in enumerate(trajectories)
    ]
    n = len(trajectories)
    print(
        f"accuracy {sum(scores) / n:.2f}  turns {sum(t.num_turns for t in trajectories) / n:.2f}  "
        f"tool calls {sum(t.tool_calls for t in trajectories)}  tool errors {sum(t.tool_errors for t in trajectories)}  "
        f"generated tokens {sum(t.generated_tokens for t in trajectories)}  "
        f"tool tokens {sum(len(t.response_ids) - t.generated_tokens for t in trajectories)}"
    )


if __name__ == "__main__":
    main()
