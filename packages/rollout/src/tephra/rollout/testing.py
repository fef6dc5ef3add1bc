"""Test helpers shared by the rollout, agent-loop and controller tests: a tiny causal LM with a
byte-level BPE tokenizer, built in about a second and saved as a normal Hugging Face folder
(config.json, model.safetensors, tokenizer files) that transformers and vLLM both load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from tephra.engine_api.multimodal import MultimodalInputs
from tephra.rollout.base import Rollout, RolloutOutput, SamplingParams
from tephra.rollout.samples import Sample

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
"""Special tokens of the tiny tokenizer (Qwen/Hermes names, so chat templates and tool-call
parsers written for Qwen work). `<|endoftext|>` pads, `<|im_end|>` is EOS."""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as in Qwen (without tool descriptions)."""

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 plus 30? The answer is 42.",
    "Compute 7 times 6 and answer with just the number.",
    '<tool_call>{"name": "python", "arguments": {"code": "print(2 + 2)"}}</tool_call>',
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "user assistant system tool answer question number result",
]


@dataclass(frozen=True)
class TinyModel:
    """Where the tiny model was saved and its special ids."""

    path: str
    """Folder with config, weights and tokenizer (pass as `model_path`)."""
    vocab_size: int
    eos_token_id: int
    """`<|im_end|>`."""
    pad_token_id: int
    """`<|endoftext|>`."""


def build_tiny_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer trained on a few sentences (any text encodes: bytes are in
    the base alphabet). Returns a `PreTrainedTokenizerFast` with a ChatML chat template."""
    # tokenizers and transformers take seconds to import; the controller's config checks
    # import this module (the `tiny` model)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:]),
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    path: str | Path,
    *,
    model_type: str = "qwen2",
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.1,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> TinyModel:
    """Build, initialise (seeded) and save a tiny `qwen2`, `llama` or `qwen2_moe` (4 experts,
    top-2, a gated shared expert) causal LM and its tokenizer to `path`. `initializer_range` is larger than usual so the next-token
    distributions are peaked (greedy ties are unlikely, EOS does occur).

    The head size `hidden_size // num_heads` must be one vLLM's CPU attention supports
    (32, 64, 80, 96, 112, 128, ...): the default 64 / 2 = 32 is the smallest."""
    # transformers: seconds to import, only when a model is built
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in ("qwen2", "llama", "qwen2_moe"):
        raise ValueError(f"model_type={model_type!r}: choose 'qwen2', 'llama' or 'qwen2_moe'")
    moe = (
        dict(
            moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if model_type == "qwen2_moe"
        else {}
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(vocab_size)
    vocab = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        torch_dtype="float32",
        **moe,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return TinyModel(path=str(path), vocab_size=vocab, eos_token_id=eos, pad_token_id=pad)


def perturbed_weights(
    model_path: str | Path, scale: float = 0.5, seed: int = 1
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the model at `model_path` with every weight changed by seeded
    noise: 'new weights' for weight-sync tests. Returns a list (it is iterated twice). A tied
    model's shared matrix appears once, under the embedding's name."""
    # transformers: seconds to import, only when a model is loaded
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    # named_parameters lists a tied matrix once (as the embedding), like a trainer's export
    for name, tensor in model.named_parameters():
        tensor = tensor.detach()  # type: ignore[assignment]  # a Parameter's plain tensor
        noise = torch.randn(tensor.shape, generator=gen) * scale * (tensor.float().std() + 1e-3)
        out.append((name, (tensor.float() + noise).to(tensor.dtype)))
    return out


def live_processes(marker: str) -> list[int]:
    """Pids whose command line holds `marker`, zombies (exited, not yet reaped) left out
    (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() not in (entry / "cmdline").read_bytes():
                    continue
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                found.append(int(entry.name))
    return found


class ScriptedRollout(Rollout):
    """A model whose turn k of every trajectory is `script(session, k)` (+ EOS); turns past the
    script go to `fallback` (a real backend) when given. Records every request. With
    `weight_version` set, scripted tokens are tagged with it (as `hf` does)."""

    weight_version: int | None = None

    def __init__(
        self,
        tokenizer: Any,
        script: Callable[[str | None, int], str | None],
        fallback: Rollout | None = None,
        events: list | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.fallback = fallback
        self.config = fallback.config if fallback is not None else None  # type: ignore[assignment]  # no config without a fallback
        self.turns: dict[str | None, int] = {}
        self.requests: list[tuple[str | None, list[int], Sample]] = []
        self.events = events if events is not None else []
        self.in_flight = self.peak_in_flight = 0

    async def agenerate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session_id: str | None = None,
        multimodal: MultimodalInputs | None = None,
    ) -> Sample:
        """The script's text for this session's turn (images, if any, do not change it); past
        the script's turns, the fallback's generation, given the images too."""
        turn = self.turns.get(session_id, 0)
        self.turns[session_id] = turn + 1
        text = self.script(session_id, turn)
        self.events.append(("gen_start", session_id, turn))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if text is None:
                # the script returns None only past its turns, where a fallback is given
                gen = await cast(Rollout, self.fallback).agenerate(
                    prompt_ids, sampling, session_id, multimodal
                )
            else:
                await asyncio.sleep(0)
                ids = self.tokenizer.encode(text, add_special_tokens=False)[
                    : sampling.max_tokens - 1
                ]
                ids.append(self.tokenizer.eos_token_id)
                versions = None if self.weight_version is None else [self.weight_version] * len(ids)
                gen = Sample(
                    response_ids=ids,
                    log_probs=[-0.01 * (i + 1) for i in range(len(ids))],
                    finish_reason="stop",
                    token_versions=versions,
                )
        finally:
            self.in_flight -= 1
        self.events.append(("gen_end", session_id, turn))
        self.requests.append((session_id, list(prompt_ids), gen))
        return gen

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        raise NotImplementedError("scripted model serves agenerate only")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass


def reference_greedy(
    model: Any, prompt: list[int], max_new_tokens: int, eos: int | None = None
) -> list[int]:
    """`model.generate` (greedy) on one unpadded prompt on the model's device, cut after the
    first EOS (None: no EOS): what the `hf` backend's greedy output must equal."""
    ids = torch.tensor([prompt], device=model.device)
    model.generation_config.eos_token_id = eos
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def teacher_forced_log_probs(
    model: Any, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each response token from one forward pass (T = 0 counts as
    1), on the CPU."""
    ids = torch.tensor([prompt + response], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float().cpu()
    scale = temperature if temperature > 0 else 1.0
    return (
        torch.log_softmax(logits / scale, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)
    )


class ReplayRollout:
    """Replays the assistant turns of one transcript (the `agenerate` half of `Rollout`)."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.calls = tokenizer, turns, 0

    async def agenerate(
        self, prompt_ids: list[int], sampling: Any, session_id: str | None = None
    ) -> Sample:
        text = self.turns[self.calls]
        self.calls += 1
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Sample(response_ids=ids, log_probs=[0.0] * len(ids), finish_reason="stop")
