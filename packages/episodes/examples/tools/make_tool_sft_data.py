"""Synthetic tool-call transcripts for warming up a model with SFT (apps/sft) before RL:
arithmetic questions answered by one `python` call and the number it printed.

    uv run python packages/episodes/examples/tools/make_tool_sft_data.py out.jsonl --n 2000

Each line is `{"messages": [...]}` (the format apps/sft reads). The tool message holds exactly
what the sandboxed python tool prints for the call (tested in test_agent_sft_data.py), so a
model trained on these sees the same tool turns in RL. Render them with the same chat template
as the RL prompts (e.g. `TOOL_CHAT_TEMPLATE`), and with `render_tool_schemas=False` in the RL
loop if, as here, the system prompt itself describes the tool.
"""

from __future__ import annotations

import argparse
import json
import random

SYSTEM = (
    'You can run Python: write <tool_call>{"name": "python", "arguments": {"code": ...}}'
    "</tool_call> and read the printed result. End with 'Answer: <number>'."
)


def tool_call_transcript(rng: random.Random) -> list[dict]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    op = rng.choice(["+", "-", "*"])
    expression = f"{a} {op} {b}"
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    call = json.dumps({"name": "python", "arguments": {"code": f"print({expression})"}})
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Calculate {expression}."},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": f"{value}\n"},
        {"role": "assistant", "content": f"Answer: {value}"},
    ]


def tool_call_transcripts(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [tool_call_transcript(rng) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output .jsonl")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.out, "w") as f:
        for messages in tool_call_transcripts(args.n, args.seed):
            f.write(json.dumps({"messages": messages}) + "\n")


if __name__ == "__main__":
    main()
