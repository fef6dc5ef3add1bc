"""An RL loop written against the `tinker` SDK alone, for a tephra serve server (or any
Tinker-compatible one): sample groups of responses with their log-probs from the server's
sampler, score them, centre each group's rewards (GRPO's advantages without the division by
the standard deviation), and take one `importance_sampling` step per batch; the held-out
reward before and after says whether it learned.

Two tasks:
- `target` (the `tiny` model, seconds): a 4-token prompt of random tokens from 32..255; the
  reward is the fraction of the 4 response tokens below 32 (1/8 of the vocabulary: a random
  model scores about 0.125). Held out: 32 fresh prompts, 4 samples each at temperature 1.
- `arithmetic` (the demo's model and task, minutes): reasoning-gym `basic_arithmetic`, two
  one-digit terms, + - *, SmolLM2-135M-Instruct's chat template, reward 1 when the last number
  of the response is the answer; held out: the demo's 200 items (seed 9999), greedy.

    uv run apps/serve --api-key tml-x --model tiny=tiny &
    uv run python apps/serve/examples/rl_loop.py --base-url http://127.0.0.1:8000 \
        --api-key tml-x --task target
    uv run apps/serve --api-key tml-x --model smollm2=demo &
    uv run python apps/serve/examples/rl_loop.py --base-url http://127.0.0.1:8000 \
        --api-key tml-x --task arithmetic --base-model smollm2

The last line printed is a JSON summary: held-out reward before and after, steps, seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import tinker
from tinker import types


@dataclass
class Task:
    """Prompts (token ids) and how a response is scored."""

    train: list[list[int]]
    """Training prompts, drawn in order, `prompts_per_step` a step."""
    heldout: list[list[int]]
    reward: Callable[[int, list[int], bool], float]
    """`reward(prompt_index, response_tokens, heldout)`."""
    max_tokens: int
    stop: list[int] = field(default_factory=list)
    heldout_samples: int = 1
    heldout_temperature: float = 0.0


def target_task(seed: int = 0, train_size: int = 512, heldout_size: int = 32) -> Task:
    """The `tiny` model's task: emit tokens below 32."""
    rng = random.Random(seed)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(32, 256) for _ in range(4)] for _ in range(n)]

    train, heldout = prompts(train_size), prompts(heldout_size)
    return Task(
        train=train,
        heldout=heldout,
        reward=lambda i, tokens, heldout: sum(t < 32 for t in tokens) / max(len(tokens), 1),
        max_tokens=4,
        heldout_samples=4,
        heldout_temperature=1.0,
    )


def arithmetic_task(tokenizer_folder: str, heldout_size: int = 200) -> Task:
    """The demo's task (apps/ppo's default) with its tokenizer's chat template; held out: the
    first `heldout_size` of the demo's 200 held-out items."""
    # tephra's helpers build the demo's exact prompts (from apps/ppo's default preset, in the
    # workspace) and scorer (imported here: only this task needs them and reasoning-gym is
    # slow to import)
    from transformers import AutoTokenizer

    from tephra.apps.ppo.config import app_defaults
    from tephra.controller.data.prompts import chat_prompt_ids, reasoning_gym_records
    from tephra.episodes.rewards.reasoning_gym_tasks import reasoning_gym_score

    data = app_defaults().data  # the demo's data: apps/ppo's default preset
    tok = AutoTokenizer.from_pretrained(tokenizer_folder)

    def records(size: int, seed: int) -> list:
        return reasoning_gym_records(data.task, size, seed, data.task_config, data.instruction)

    train_rec = records(data.train_size, data.train_seed)
    held_rec = records(data.val_size, data.val_seed)[:heldout_size]

    def reward(i: int, tokens: list[int], heldout: bool) -> float:
        rec = (held_rec if heldout else train_rec)[i]
        text = tok.decode(tokens, skip_special_tokens=True)
        return reasoning_gym_score(rec.data_source, text, rec.ground_truth, rec.extra_info)

    return Task(
        train=[chat_prompt_ids(tok, r.messages) for r in train_rec],
        heldout=[chat_prompt_ids(tok, r.messages) for r in held_rec],
        reward=reward,
        max_tokens=32,
        stop=[tok.eos_token_id],
    )


def heldout_reward(sampler: tinker.SamplingClient, task: Task, seed: int = 12345) -> float:
    """Mean reward over the held-out prompts (`heldout_samples` each)."""

    def params(i: int) -> types.SamplingParams:
        # sample j of prompt i draws from seed + i * n + j: no two samples share a stream
        return types.SamplingParams(
            max_tokens=task.max_tokens,
            temperature=task.heldout_temperature,
            seed=seed + i * task.heldout_samples,
            stop=task.stop or None,
        )

    futures = [
        sampler.sample(types.ModelInput.from_ints(p), task.heldout_samples, params(i))
        for i, p in enumerate(task.heldout)
    ]
    scores = [
        task.reward(i, seq.tokens, True)
        for i, f in enumerate(futures)
        for seq in f.result().sequences
    ]
    return float(np.mean(scores))


def datum(prompt: list[int], tokens: list[int], logprobs: list[float], adv: float) -> types.Datum:
    """One sampled response as an `importance_sampling` datum: the prompt's positions carry
    advantage 0, each response token the response's advantage over its length (the loss is a
    sum over tokens: so every response weighs the same whatever its length, as the demo's
    `seq-mean-token-mean`)."""
    row = prompt + tokens
    n_prompt = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(row[:-1]),
        loss_fn_inputs={
            "target_tokens": row[1:],
            "logprobs": [0.0] * n_prompt + list(logprobs),
            "advantages": [0.0] * n_prompt + [adv / len(tokens)] * len(tokens),
        },
    )


def train(
    service: tinker.ServiceClient,
    task: Task,
    *,
    base_model: str,
    steps: int,
    prompts_per_step: int,
    samples_per_prompt: int,
    learning_rate: float,
    rank: int = 8,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Train a new LoRA client on `task`; returns the held-out reward before and after."""
    start = time.monotonic()
    tc = service.create_lora_training_client(base_model=base_model, rank=rank).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    before = heldout_reward(sampler, task)
    log(f"held-out reward before: {before:.3f}")
    adam = types.AdamParams(learning_rate=learning_rate)
    train_rewards = []
    for step in range(steps):
        first = step * prompts_per_step
        indices = [(first + k) % len(task.train) for k in range(prompts_per_step)]
        futures = []
        for k, i in enumerate(indices):
            params = types.SamplingParams(
                max_tokens=task.max_tokens,
                temperature=1.0,
                seed=((seed * steps + step) * prompts_per_step + k) * samples_per_prompt,
                stop=task.stop or None,
            )
            prompt = types.ModelInput.from_ints(task.train[i])
            futures.append(sampler.sample(prompt, samples_per_prompt, params))
        data, rewards = [], []
        for i, fut in zip(indices, futures):
            seqs = fut.result().sequences
            scores = np.array([task.reward(i, s.tokens, False) for s in seqs])
            rewards.extend(scores)
            for s, adv in zip(seqs, scores - scores.mean()):
                if adv != 0.0 and s.tokens:
                    data.append(datum(task.train[i], s.tokens, s.logprobs, float(adv)))
        if data:  # a batch where every group scored alike carries no signal
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(adam)
            fb.result(), opt.result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        train_rewards.append(float(np.mean(rewards)))
        log(f"step {step + 1}: train reward {train_rewards[-1]:.3f} ({len(data)} datums)")
    after = heldout_reward(sampler, task)
    log(f"held-out reward after: {after:.3f}")
    return {
        "heldout_before": before,
        "heldout_after": after,
        "train_rewards": train_rewards,
        "steps": steps,
        "seconds": time.monotonic() - start,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("--task", choices=["target", "arithmetic"], default="target")
    p.add_argument("--base-model", default="tiny", help="a --model NAME of the server")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-size", type=int, default=200, help="arithmetic: held-out items")
    args = p.parse_args(argv)
    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    if args.task == "target":
        task = target_task(args.seed)
        settings = dict(steps=12, prompts_per_step=8, samples_per_prompt=8, learning_rate=3e-2)
    else:
        from tephra.controller.data.smollm2 import smollm2_folder  # the demo's tokenizer

        task = arithmetic_task(str(smollm2_folder()), args.heldout_size)
        settings = dict(steps=12, prompts_per_step=4, samples_per_prompt=8, learning_rate=3e-4)
    if args.steps is not None:
        settings["steps"] = args.steps
    if args.learning_rate is not None:
        settings["learning_rate"] = args.learning_rate
    summary = train(service, task, base_model=args.base_model, seed=args.seed, **settings)  # type: ignore[arg-type]
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
