"""The trainer on the `vllm` rollout backend (a real vLLM CPU server): the colocated worker's
rollout log-probs against its engine's, the server following each update in memory, and the
app's smoke presets (plain and multi-turn with the python tool) and its tiny vision-language
preset (images on the server) training 2 steps."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch

from tephra.apps.ppo.main import parse_config, run
from tephra.controller.launch.ppo import prepare
from tephra.controller.run.models import resolve_model_path
from tephra.controller.run.trackers import read_jsonl
from tephra.controller.samples import samples_to_batch
from tephra.controller.testing import SMOKE_REWARD, untimed_metrics
from tephra.controller.workers.rl_worker import RLWorker
from tephra.rollout import RolloutConfig, SamplingParams, get_rollout
from tephra.rollout.backends.server_process import free_port
from tephra.rollout.fixtures import vllm_env_python

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return vllm_env_python(REPO)


def _config(tmp_path, vllm_python, *overrides):
    reward = tmp_path / "reward.py"
    reward.write_text(SMOKE_REWARD)
    return parse_config(
        [
            "-p",
            "smoke",
            f"reward.custom_function_path={reward}",
            "rollout.backend=vllm",
            f"rollout.vllm.python={vllm_python}",
            f"trainer.run_dir={tmp_path / 'run'}",
            *overrides,
        ]
    )


def test_worker_on_vllm_matches_its_engine_and_follows_updates(
    tmp_path, vllm_python, reference_grad_norm
):
    cfg = _config(tmp_path, vllm_python, "rollout.vllm.weight_bucket_mb=0.05")
    prepared = prepare(cfg)
    worker = RLWorker(0, 1, "127.0.0.1", free_port(), 1, cfg=cfg, model_path=prepared.model_path)
    hf = None
    try:
        rollout = worker.rollout
        assert rollout.update_count == 1 and rollout.last_update_stats["buckets"] > 1
        tok = prepared.tokenizer
        items = [prepared.train.item(i, f"p{i}") for i in range(2)]
        sampling = SamplingParams(
            n=4, temperature=1.0, max_tokens=8, seed=5, stop_token_ids=(tok.eos_token_id,)
        )
        samples = worker.generate(items, sampling, score=False)
        batch = samples_to_batch(samples, tok.pad_token_id, n=4, multi_turn=False)
        mask = batch["response_mask"].bool()

        # the server's per-token log-probs are the trainer's (fp32), token for token
        trainer = worker.compute_log_probs(batch)["log_probs"]
        gap = (trainer - batch["rollout_log_probs"]).abs()[mask]
        assert mask.sum() > 0 and gap.max() < TOL

        # one update of the actor, then the sync: in memory, nothing in the weights folder
        files = sorted(p.name for p in rollout.weights_dir.iterdir())
        advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
        batch["advantages"] = advantages
        batch["global_token_count"] = torch.full((len(samples),), float(mask.sum()))
        batch["global_seq_count"] = torch.full((len(samples),), float(len(samples)))
        metrics = worker.update_actor(batch)
        # one mini-batch, on-policy (ratio 1), the smoke preset's seq-mean-token-mean: the
        # gradient of -(1/B) sum_i (1/|y_i|) sum_t A_it log pi(y_it) at the initial weights,
        # recomputed in transformers
        rows = [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids} for s in samples]
        assert cfg.actor.objective.loss_agg_mode == "seq-mean-token-mean"
        coefs = [
            (-advantages[i][mask[i]] / (mask[i].sum() * len(samples))).tolist()
            for i in range(len(samples))
        ]
        want = reference_grad_norm(prepared.model_path, rows, coefs)
        assert metrics["grad_norm"] == pytest.approx(want, rel=1e-3)
        worker.sync_weights()
        assert rollout.update_count == 2
        assert sorted(p.name for p in rollout.weights_dir.iterdir()) == files

        # the server generates what HF generates with the engine's updated weights
        hf = get_rollout("hf", RolloutConfig(model_path=prepared.model_path, max_model_len=256))
        with worker.actor.eval_mode():
            hf.update_weights(
                itertools.chain.from_iterable(
                    worker.actor.export_weights(untie_word_embeddings=True)
                )
            )
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        prompts = [list(i.prompt_ids) for i in items]
        ours, reference = rollout.generate(prompts, greedy), hf.generate(prompts, greedy)
        assert ours.response_ids == reference.response_ids
        for a, b in zip(ours.log_probs, reference.log_probs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=TOL, rtol=0)
        after = worker.compute_log_probs(
            samples_to_batch(
                worker.generate(items, sampling, score=False),
                tok.pad_token_id,
                n=4,
                multi_turn=False,
            )
        )
        assert not torch.equal(after["log_probs"], trainer)
    finally:
        worker.rollout.close()
        if hf is not None:
            hf.close()


@pytest.mark.parametrize("preset", ["smoke", "smoke_tools"])
def test_app_trains_two_steps_on_vllm(
    ray_session, tmp_path, vllm_python, preset, grpo_step_reference, smoke_score
):
    """Validation goes through the same server: greedy before training (smoke), 2 samples per
    prompt at temperature 1 after it (smoke_tools, multi-turn). The accuracy, the rewards and
    advantages, and (smoke) step 1's loss and grad norm are recomputed from the dumped
    samples, as the hf backend's twin tests do."""
    extra = (
        [
            "-p",
            "smoke_tools",
            "trainer.val_after=true",
            "trainer.val.n=2",
            "trainer.val.temperature=1.0",
            "trainer.val.ks=[1,2]",
        ]
        if preset == "smoke_tools"
        else ["trainer.val_before=true"]
    )
    cfg = _config(tmp_path, vllm_python, *extra, "trainer.dump_generations=1")
    result = run(cfg)
    assert result["steps"] == 2
    tools = preset == "smoke_tools"
    accuracy = result["accuracy_after" if tools else "accuracy_before"]
    # the validation's samples (8 held-out prompts; 2 each for smoke_tools), scored by the
    # smoke reward on their text; accuracy is the share with a full score
    gens = tmp_path / "run" / "generations"
    val = [json.loads(x) for x in (gens / f"val_step{2 if tools else 0}.jsonl").open()]
    n = 2 if tools else 1
    assert [r["prompt_index"] for r in val] == [k // n for k in range(8 * n)]
    assert [r["score"] for r in val] == [smoke_score(r["response"]) for r in val]
    assert accuracy == pytest.approx(sum(r["score"] >= 1 for r in val) / len(val))
    # step 0: validation before training (smoke)
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["time/sync_s"] > 0
        rows = [json.loads(x) for x in (gens / f"train_step{r['step']}.jsonl").open()]
        assert len(rows) == 8 and [x["score"] for x in rows] == [
            smoke_score(x["response"]) for x in rows
        ]
        lengths = [sum(x["response_mask"]) for x in rows]
        assert r["response/length_mean"] == pytest.approx(sum(lengths) / len(lengths))
        # step 1 trains the initial weights on their own samples (one mini-batch): its loss
        # and gradient recomputed in transformers (single-turn only)
        first = r["step"] == 1 and not tools
        want = grpo_step_reference(resolve_model_path("tiny", 0) if first else None, rows)
        assert [x["advantage"] for x in rows] == pytest.approx(want["advantages"], abs=1e-5)
        assert r["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6)
        # every step trains on its own samples (one mini-batch, ratio 1 up to the server's
        # rounding, no KL or entropy term): the loss is -sum_i A_i |y_i| / N of its rows
        assert r["actor/loss"] == pytest.approx(want["pg_loss"], abs=1e-4)
        if first:
            assert r["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-4)
            assert r["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)
    if tools:
        assert records[0]["agent/turns_mean"] >= 1
        return
    # the run's Hugging Face export loads in vLLM and generates what transformers generates
    config = RolloutConfig(model_path=str(tmp_path / "run" / "hf"), max_model_len=256)
    config.vllm.python = vllm_python
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    with get_rollout("vllm", config) as served, get_rollout("hf", config) as reference:
        ours, theirs = served.generate(prompts, greedy), reference.generate(prompts, greedy)
    assert ours.response_ids == theirs.response_ids


def test_lora_adapter_syncs_to_vllm_through_the_app(ray_session, tmp_path, vllm_python):
    """`actor.lora.rank=4` on the vLLM backend: the syncs send the adapter alone (the default
    `actor.lora_sync=auto` resolves to adapter-only there), which the server loads under a
    new name each step over its unchanged base weights. Every step's probe rows score the
    sampled tokens in the trainer: its log-probs are the server's up to rounding (with the
    adapter left unapplied, this lr moved kl_k3 to 0.37 at step 2 on the hf twin)."""
    cfg = _config(
        tmp_path,
        vllm_python,
        "actor.lora.rank=4",
        "actor.lora.alpha=8",
        "actor.optimizer.lr=0.05",  # each step moves the policy by much
    )
    assert cfg.adapter_sync
    assert run(cfg)["steps"] == 2
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout_corr/probe_rows"] == 8.0
        assert row["rollout_corr/kl_k3"] < 1e-4, row["rollout_corr/kl_k3"]


def test_vlm_trains_two_steps_on_vllm(
    ray_session, tmp_path, vllm_python, grpo_step_reference, ppo_updates_reference, step_images
):
    """Images on the vLLM server: the vlm_smoke preset (GRPO on a tiny random Qwen2-VL whose
    vision tower trains too) for 2 steps with 2 mini-batches. Each step the server's log-probs
    of the sampled responses to the images equal the fsdp engine's recomputed ones (fp32), so
    at step 2 the server holds the vision tower that step 1 trained."""
    cfg = parse_config(
        [
            "-p",
            "vlm_smoke",
            "batch.mini_batches=2",
            "rollout.backend=vllm",
            f"rollout.vllm.python={vllm_python}",
            "trainer.dump_generations=1",
            f"trainer.run_dir={tmp_path}",
        ]
    )
    assert run(cfg)["steps"] == 2
    train = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["rollout_corr/log_prob_abs_gap_mean"] < TOL
        assert abs(math.log(r["rollout_corr/ratio_max"])) < TOL
        assert r["reward/errors"] == 0 and r["time/sync_s"] > 0
        # the logged reward mean and GRPO advantages are those of the dumped samples
        path = tmp_path / "generations" / f"train_step{r['step']}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        want = grpo_step_reference(None, rows)
        assert [x["advantage"] for x in rows] == pytest.approx(want["advantages"], abs=1e-5)
        assert r["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6)
    # both steps' updates in plain transformers with each prompt's image drawn again, two
    # mini-batches with an AdamW step between, step 2 from the weights step 1 left: the loss
    # and the gradient norm
    images = step_images(cfg, 2)
    steps = []
    for k in (1, 2):
        path = tmp_path / "generations" / f"train_step{k}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        adv = [r["advantage"] for r in rows]
        steps.append((rows, adv, [images[k - 1][r["prompt_index"]] for r in rows]))
    for record, want in zip(train, ppo_updates_reference(cfg, steps), strict=True):
        assert record["actor/pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-5), record
        assert record["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), record


def test_killed_vllm_server_is_restarted_and_the_run_matches(
    ray_session, tmp_path, vllm_python, capsys
):
    """SIGKILL the rollout's vLLM server once step 2's checkpoint is written, during step 3 (or
    4) of a 4-step run (checkpoints every 2 steps): the trainer rebuilds the worker group (a
    fresh server), continues from step 2's checkpoint and ends with the metrics and weights of
    an uninterrupted run."""
    import os
    import signal
    import threading
    import time

    import ray
    from safetensors.torch import load_file

    from tephra.rollout.testing import live_processes

    session = ray._private.worker._global_node.get_session_dir_path().encode()

    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    def ours(pid: int) -> bool:
        """A server started by a worker of this module's Ray session (other test files run
        their own sessions and servers at the same time)."""
        try:
            return session in Path(f"/proc/{parent(parent(pid))}/cmdline").read_bytes()
        except (OSError, ValueError):
            return False

    killed: list[int] = []

    def killer():
        done = tmp_path / "killed" / "checkpoints" / "step_2" / "manifest.json"
        deadline = time.monotonic() + 600
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [p for p in live_processes("vllm.entrypoints.openai.api_server") if ours(p)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        killed.extend(pids)

    def cfg(run_dir):
        return _config(
            tmp_path,
            vllm_python,
            "trainer.steps=4",
            "trainer.save_every=2",
            f"trainer.run_dir={tmp_path / run_dir}",
        )

    run(cfg("uninterrupted"))
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    summary = run(cfg("killed"))
    thread.join()
    assert killed and summary["steps"] == 4
    out = capsys.readouterr().out
    # the kill lands in step 3, or in step 4 where a loaded machine scans /proc slower than
    # step 3 runs: either way the run goes back to step 2's checkpoint
    failed = re.search(r"worker group failed at step (\d+) \(", out)
    assert failed and failed.group(1) in ("3", "4") and "vllm server died" in out, out
    assert "restart 1 of 1" in out and "step_2 at step 2" in out

    def rows(run_dir):
        return [untimed_metrics(r) for r in read_jsonl(tmp_path / run_dir / "metrics.jsonl")]

    assert rows("killed") == rows("uninterrupted")
    a = load_file(tmp_path / "killed" / "hf" / "model.safetensors")
    b = load_file(tmp_path / "uninterrupted" / "hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)
