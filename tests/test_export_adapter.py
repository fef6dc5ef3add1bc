"""A LoRA-trained actor's checkpoint exports two ways that agree: merged (a plain HF folder)
and as a peft adapter (`--adapter`) over the run's base model; their log-probs match within
1e-5 in fp32, and both differ from the base model's (the adapter is not a no-op)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from tephra.core.errors import CheckpointError


def _lora_checkpoint(tmp_path, *overrides):
    """A run folder with the config and one committed checkpoint of a LoRA actor trained
    two steps in this process (no Ray): what `apps/ppo` leaves behind."""
    import torch.distributed as dist

    from tephra.apps.ppo.main import parse_config
    from tephra.controller.run.checkpoints import CheckpointManager
    from tephra.controller.run.models import resolve_model_path
    from tephra.core.config import to_dict
    from tephra.engine_api.registry import get_engine
    from tephra.engine_api.testing.batches import nll_loss_fn, random_batch

    run = tmp_path / "run"
    cfg = parse_config(
        [
            "-p",
            "smoke",
            "actor.lora.rank=4",
            "actor.lora.alpha=8",
            "actor.optimizer.lr=0.05",
            f"trainer.run_dir={run}",
            *overrides,
        ]
    )
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    model_path = resolve_model_path(cfg.model.path, cfg.trainer.seed)
    model = replace(cfg.model, path=model_path, init_seed=cfg.trainer.seed)
    engine = get_engine(
        "fsdp", cfg.actor.engine_config(model, "policy", 1.0, cfg.trainer.seed, device="cpu")
    )
    try:
        with engine.train_mode():
            for step in range(2):
                engine.forward_backward(random_batch(100, 4, seed=step), nll_loss_fn)
                engine.optimizer_step()
        manager = CheckpointManager(run / "checkpoints")
        folder = manager.begin(2)
        engine.save_checkpoint(folder / "actor")
        return manager.commit(2, {}), model_path
    finally:
        if engine.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.multiproc
def test_lora_checkpoint_exports_merged_and_as_a_peft_adapter(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tephra.controller.launch.export import export_checkpoint, main

    step, base_path = _lora_checkpoint(tmp_path)
    merged = export_checkpoint(step, tmp_path / "merged")
    main([str(step), str(tmp_path / "adapter"), "--adapter"])  # the command line
    adapter = tmp_path / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    def log_probs(model):
        ids = torch.tensor([[3, 17, 42, 8, 99, 5, 61, 23]])
        with torch.no_grad():
            logits = model.eval()(input_ids=ids).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def base():
        return AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)

    want = log_probs(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32))
    got = log_probs(PeftModel.from_pretrained(base(), adapter))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (want - log_probs(base())).abs().max() > 1e-3  # LoRA changed the policy

    # a run without LoRA has no adapter to write: refused by name, before any process starts
    config = step.parent.parent / "config.yaml"
    data = yaml.safe_load(config.read_text())
    data["actor"]["lora"]["rank"] = 0
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(
        CheckpointError,
        match=r"--adapter writes the LoRA adapter .* asked for "
        r"role 'actor' .* actor.lora.rank=0. Export without --adapter",
    ):
        export_checkpoint(step, tmp_path / "never", adapter=True)
