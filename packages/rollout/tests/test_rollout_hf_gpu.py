"""The `hf` backend on a CUDA device (`hf.device=cuda`) against transformers on the same
device: greedy decoding, log-probs, seeded sampling, a weight update, sleep and wake-up.

Selected with `pytest -m gpu`; skipped where no CUDA device is visible (CI, this CPU).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tephra.rollout import RolloutConfig, SamplingParams, get_rollout
from tephra.rollout.testing import perturbed_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = [[5, 6, 7], [10, 20, 30, 40, 50, 60, 70], [100]]


def _reference(path, weights=None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(dict(weights), strict=False)
    return model.to("cuda").eval()


def _greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt], device="cuda")
    model.generation_config.eos_token_id = None
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _teacher_forced(model, prompt, response):
    ids = torch.tensor([prompt + response], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response, device="cuda")[:, None])[:, 0]


def test_hf_rollout_on_cuda(tiny_model):
    config = RolloutConfig(model_path=tiny_model.path, max_model_len=128, hf={"device": "cuda"})
    rollout = get_rollout("hf", config)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        reference = _reference(tiny_model.path)
        out = rollout.generate(PROMPTS, greedy)
        for i, prompt in enumerate(PROMPTS):
            assert out.response_ids[i] == _greedy(reference, prompt, 16)
            recomputed = _teacher_forced(reference, prompt, out.response_ids[i]).cpu()
            torch.testing.assert_close(torch.tensor(out.log_probs[i]), recomputed, atol=1e-4, rtol=0)

        sampled = SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=7, ignore_eos=True)
        first, again = rollout.generate(PROMPTS, sampled), rollout.generate(PROMPTS, sampled)
        assert first.response_ids == again.response_ids  # the seed fixes the CUDA draws
        assert len({tuple(r) for r in first.response_ids}) > 3

        new = perturbed_weights(tiny_model.path)
        rollout.update_weights(new)
        after = rollout.generate(PROMPTS, greedy)
        moved = _reference(tiny_model.path, new)
        for i, prompt in enumerate(PROMPTS):
            assert after.response_ids[i] == _greedy(moved, prompt, 16)

        del reference, moved
        torch.cuda.empty_cache()
        awake = torch.cuda.memory_allocated()
        rollout.sleep()
        assert torch.cuda.memory_allocated() < awake  # the weights left the GPU
        rollout.wake_up()
        assert rollout.generate(PROMPTS, greedy).response_ids == after.response_ids
    finally:
        rollout.close()
