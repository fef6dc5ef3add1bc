"""SFT end to end through Ray: the assistant mask is exactly the assistant turns, training
lowers the loss on a fixed probe batch, and the export loads in transformers with the same
NLL as the engine measured."""

from __future__ import annotations

import json

import pytest
import torch

from tephra.apps.sft.chat_data import tokenize_conversation
from tephra.apps.sft.main import parse_config, run
from tephra.rollout.testing import build_tiny_tokenizer


def test_assistant_mask_covers_exactly_the_assistant_turns():
    tok = build_tiny_tokenizer()
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "sure?"},
        {"role": "assistant", "content": "Yes, 5."},
    ]
    ids, mask = tokenize_conversation(tok, conv)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    # hand-written expectation: each assistant content and its end-of-turn marker, nothing else
    assert trained == "5<|im_end|>\nYes, 5.<|im_end|>\n"


@pytest.mark.multiproc
def test_sft_lowers_loss_and_export_loads(tmp_path, reference_lrs):
    import ray

    from tephra.controller.cluster.worker_group import ray_init

    ray_init(num_cpus=2)
    try:
        convs = tmp_path / "chats.jsonl"
        convs.write_text(
            "\n".join(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"What is {a} plus {b}?"},
                            {"role": "assistant", "content": f"The answer is {a + b}."},
                        ]
                    }
                )
                for a in range(4)
                for b in range(4)
            )
        )
        common = [
            "-p",
            "smoke",
            f"data.train_files=[{convs}]",
            "policy.scheduler.name=cosine",
            "policy.scheduler.total_steps=8",
            "policy.scheduler.min_lr_ratio=0.1",
        ]
        cfg = parse_config([*common, f"train.run_dir={tmp_path / 'sft'}"])
        summary = run(cfg)
        # resume: 4 steps, a checkpoint, then the same command to 8 steps continues from it
        split = [
            *common,
            "train.save_every=4",
            "train.export_hf=false",
            f"train.run_dir={tmp_path / 'split'}",
        ]
        run(parse_config([*split, "train.steps=4"]))
        resumed = run(parse_config(split))
    finally:
        ray.shutdown()
    from tephra.controller.run.trackers import read_jsonl

    def train_rows(path):  # the first run's closing val/loss shares step 4's row: left out
        return [
            {k: v for k, v in r.items() if k != "val/loss"}
            for r in read_jsonl(path / "metrics.jsonl")
            if "loss" in r
        ]

    full, parts = train_rows(tmp_path / "sft"), train_rows(tmp_path / "split")
    assert [r["step"] for r in parts] == list(range(1, 9))
    assert full == parts  # bitwise: the resumed run trains exactly as the uninterrupted one
    assert resumed["loss_after"] == summary["loss_after"]
    # the schedule reached the engine: step k logs the lr after its scheduler step, the lr of
    # step k + 1 by transformers' cosine_with_min_lr
    want = reference_lrs(cfg.policy.scheduler, cfg.policy.optimizer.lr, 9)[1:]
    assert [r["lr"] for r in full] == pytest.approx(want, rel=1e-9)
    assert summary["loss_after"] < 0.7 * summary["loss_before"], summary
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "sft" / "hf"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    # independent recomputation of the probe NLL with plain transformers
    from tephra.apps.sft.chat_data import pad_batch

    # the validation loss is over the held-out conversations: the last data.val_size=4
    rows = [json.loads(line)["messages"] for line in convs.read_text().splitlines()][-4:]
    batch = pad_batch([tokenize_conversation(tok, c) for c in rows], tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(
        -1, batch["input_ids"][:, 1:, None]
    )[..., 0]
    mask = batch["response_mask"][:, 1:].float()
    nll = float(-(logp * mask).sum() / mask.sum())
    assert abs(nll - summary["loss_after"]) < 1e-3, (nll, summary["loss_after"])
