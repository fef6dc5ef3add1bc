"""The `hf` backend on a CUDA device (`hf.device=cuda`) against transformers on the same
device: greedy decoding, log-probs, seeded sampling, a weight update, sleep and wake-up.

Selected with `pytest -m gpu`; skipped where no CUDA device is visible (CI, this CPU).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tephra.rollout import RolloutConfig, SamplingParams, get_rollout
from tephra.rollout.testing import perturbed_weights, reference_greedy, teacher_forced_log_probs

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


def test_hf_rollout_on_cuda(tiny_model):
    config = RolloutConfig(model_path=tiny_model.path, max_model_len=128, hf={"device": "cuda"})
    rollout = get_rollout("hf", config)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        reference = _reference(tiny_model.path)
        out = rollout.generate(PROMPTS, greedy)
        for i, prompt in enumerate(PROMPTS):
            assert out.response_ids[i] == reference_greedy(reference, prompt, 16)
            recomputed = teacher_forced_log_probs(reference, prompt, out.response_ids[i], 1.0)
            torch.testing.assert_close(
                torch.tensor(out.log_probs[i]), recomputed, atol=1e-4, rtol=0
            )

        sampled = SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=7, ignore_eos=True)
        first, again = rollout.generate(PROMPTS, sampled), rollout.generate(PROMPTS, sampled)
        assert first.response_ids == again.response_ids  # the seed fixes the CUDA draws
        assert len({tuple(r) for r in first.response_ids}) > 3

        new = perturbed_weights(tiny_model.path)
        rollout.update_weights(new)
        after = rollout.generate(PROMPTS, greedy)
        moved = _reference(tiny_model.path, new)
        for i, prompt in enumerate(PROMPTS):
            assert after.response_ids[i] == reference_greedy(moved, prompt, 16)

        del reference, moved
        torch.cuda.empty_cache()
        awake = torch.cuda.memory_allocated()
        rollout.sleep()
        assert torch.cuda.memory_allocated() < awake  # the weights left the GPU
        rollout.wake_up()
        assert rollout.generate(PROMPTS, greedy).response_ids == after.response_ids
    finally:
        rollout.close()
