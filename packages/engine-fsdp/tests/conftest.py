"""Leave no process group behind: engines built in this process at world size 1 create a
1-rank group; other packages' tests in the same pytest process must not inherit it."""

import pytest
import torch
from PIL import Image
from tensordict import TensorDict

from tephra.engine_api import batch as B
from tephra.engine_api.multimodal import MULTIMODAL, multimodal_column
from tephra.engine_fsdp.sharding import release_process_group
from tephra.rollout.multimodal import VisionProcessor  # tests only: engine-fsdp never imports it


@pytest.fixture(autouse=True, scope="module")
def _release_engine_process_group():
    yield
    release_process_group()


def _vision_batch(vlm_path: str, seed: int = 0):
    """4 rows for the tiny vision-language model at `vlm_path` (any family): two with one
    image each, then two text-only rows (so that, split over 2 data-parallel ranks, one rank
    sees no image)."""
    proc = VisionProcessor.from_pretrained(vlm_path)
    span = proc.span_text(proc.image_token)
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    prompts = [
        proc(chat.format(f"{span}what colour?"), [Image.new("RGB", (112, 112), "red")]),
        proc(chat.format(f"{span}and this?"), [Image.new("RGB", (140, 112), "blue")]),
        proc(chat.format("text only"), []),
        proc(chat.format("more text"), []),
    ]
    gen = torch.Generator().manual_seed(seed)
    seqs, resp_len = [], []
    for k, (ids, _) in enumerate(prompts):
        response = torch.randint(3, 300, (4 + 2 * k,), generator=gen).tolist()
        seqs.append(ids + response)
        resp_len.append(len(response))
    width, n = max(map(len, seqs)), len(seqs)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    resp = torch.zeros(n, width, dtype=torch.long)
    for i, (seq, r) in enumerate(zip(seqs, resp_len)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        resp[i, len(seq) - r : len(seq)] = 1
    batch = TensorDict(
        {B.INPUT_IDS: input_ids, B.ATTENTION_MASK: attn, B.RESPONSE_MASK: resp}, batch_size=[n]
    )
    batch[MULTIMODAL] = multimodal_column([m for _, m in prompts])
    return batch


@pytest.fixture
def vision_batch():
    """`vision_batch(vlm_path, seed=0)`: 4 rows for a tiny VLM, 2 with images then 2 without."""
    return _vision_batch
