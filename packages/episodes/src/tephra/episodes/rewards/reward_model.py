"""A reward model: a Hugging Face sequence classifier with one output, read from a local folder.

reward(prompt, response) = logit[0] of the classifier on the text `prompt + response`
(or, with `use_chat_template`, the tokenizer's chat template applied to a user turn holding
the prompt and an assistant turn holding the response), taken at the last non-padding token.

Batches are padded on the right so every sequence keeps positions 0..n-1 (left padding shifts
the positions of models that derive them from the index, which changes their scores), and
truncated on the left so the response, which is what is judged, survives a long prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from tephra.episodes.rewards.results import RewardError

DTYPES = ("float32", "bfloat16", "float16")


class RewardModelScorer:
    """Scores (prompt, response) texts with an `AutoModelForSequenceClassification`."""

    def __init__(
        self,
        path: str | Path,
        batch_size: int = 8,
        max_length: int = 2048,
        device: str = "cpu",
        dtype: str = "float32",
        use_chat_template: bool = False,
    ) -> None:
        # transformers takes seconds to import; only a reward model needs it
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise RewardError(
                f"reward.reward_model_path={str(path)!r} is not a Hugging Face model folder "
                f"(no config.json); save the model with save_pretrained(folder)"
            )
        if dtype not in DTYPES:
            raise RewardError(
                f"reward.reward_model_dtype={dtype!r} is not allowed; choose one of {list(DTYPES)}"
            )
        if batch_size <= 0 or max_length <= 0:
            raise RewardError(
                f"reward model batch_size={batch_size} and max_length={max_length} must be > 0"
            )
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = torch.device(device)
        self.use_chat_template = use_chat_template
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(
                folder, torch_dtype=getattr(torch, dtype)
            )
            .to(self.device)
            .eval()
        )
        if self.model.config.num_labels != 1:
            raise RewardError(
                f"reward model {folder} has num_labels={self.model.config.num_labels}; a reward "
                f"model must output one scalar (num_labels=1)"
            )
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise RewardError(
                    f"reward model tokenizer in {folder} has neither a pad nor an eos token; "
                    f"set tokenizer.pad_token before saving it"
                )
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The classifier finds each sequence's last real token through config.pad_token_id.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        if use_chat_template and not self.tokenizer.chat_template:
            raise RewardError(
                f"reward.reward_model_chat_template=True but the tokenizer in {folder} has no "
                f"chat template; set it to False to score prompt + response as plain text"
            )

    def text(self, prompt: str, response: str) -> str:
        """The text the classifier reads for one (prompt, response) pair."""
        if self.use_chat_template:
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": response},
            ]
            return cast(str, self.tokenizer.apply_chat_template(messages, tokenize=False))
        return prompt + response

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One scalar reward per (prompt, response) pair, computed `batch_size` texts at a time."""
        if len(prompts) != len(responses):
            raise RewardError(
                f"reward model: {len(prompts)} prompts but {len(responses)} responses"
            )
        texts = [self.text(p, r) for p, r in zip(prompts, responses, strict=True)]
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                encoded = self.tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                logits = self.model(**encoded).logits  # [batch, 1]
                scores.extend(logits[:, 0].float().tolist())
        return scores
