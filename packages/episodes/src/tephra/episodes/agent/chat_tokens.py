"""Token ids of the turns an agent loop appends (tool responses), without re-tokenising.

Token-in-token-out: the context of the next model turn is `prompt_ids + every id so far`, where
model turns are exactly the generated ids and each tool turn is the *delta* of the chat
template: the text the template adds after an assistant message when tool messages follow,
tokenised on its own. Earlier turns are never re-rendered or re-tokenised, so the trained
tokens are exactly the sampled ones (re-tokenising decoded text can merge or split tokens
differently, which silently breaks the log-prob ratio of PPO).

The delta is measured on a fixed dummy conversation:

    prefix = render([system, user, assistant(SENTINEL)])
    full   = render([system, user, assistant(SENTINEL), *tool_messages], add_generation_prompt)
    delta_text = closing + full[len(prefix):]

where `closing` is what the template writes after the assistant content minus the stop token
the model generated itself (for ChatML: the "\\n" after "<|im_end|>").
"""

from __future__ import annotations

from typing import Any

from tephra.core.errors import ConfigError

IMAGE_MARKER = "<image>"
"""Where an observation shows an image, in its message text (verl's marker)."""

_SENTINEL = "TEPHRA_ASSISTANT_CONTENT_SENTINEL"
_DUMMY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi."},
    {"role": "assistant", "content": _SENTINEL},
]


class ChatTemplateDelta:
    """Renders appended messages as token ids with `tokenizer`'s chat template."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "agent loop: the tokenizer has no chat_template; set tokenizer.chat_template "
                "(e.g. tephra.episodes.agent.TOOL_CHAT_TEMPLATE) to a template with a 'tool' role"
            )
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.prefix = self.render(_DUMMY, add_generation_prompt=False)
        at = self.prefix.rfind(_SENTINEL)
        if at < 0:
            raise ConfigError("agent loop: the chat template drops the assistant message content")
        self.after_assistant = self.prefix[at + len(_SENTINEL) :]

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first context: the sample's messages rendered with the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def append_text(self, messages: list[dict], stop_text: str | None) -> str:
        """Template text that follows a generated assistant turn when `messages` are appended,
        up to and including the next generation prompt. `stop_text` is the decoded stop token
        that ended the generated turn (None when it ended without one)."""
        full = self.render(_DUMMY + list(messages), add_generation_prompt=True)
        if not full.startswith(self.prefix):
            raise ConfigError(self.not_append_only(full, messages))
        closing = self.after_assistant
        if stop_text and closing.startswith(stop_text):
            closing = closing[len(stop_text) :]
        return closing + full[len(self.prefix) :]

    def not_append_only(self, full: str, messages: list[dict]) -> str:
        """The refusal of a template that re-renders earlier turns: names the model, the turn
        appended and where the earlier text changed."""
        at = next(
            (i for i, (a, b) in enumerate(zip(self.prefix, full)) if a != b),
            min(len(self.prefix), len(full)),
        )
        model = getattr(self.tokenizer, "name_or_path", "") or "(unnamed tokenizer)"
        roles = ", ".join(repr(m.get("role")) for m in messages)
        return (
            f"agent loop: the chat template of model {model} is not append-only: appending turn "
            f"{len(_DUMMY) + 1} ({roles} after the assistant's turn {len(_DUMMY)}) changes the "
            f"earlier turns' text at char {at}: {self.prefix[max(at - 10, 0) : at + 40]!r} "
            f"became {full[max(at - 10, 0) : at + 40]!r}. Token-in-token-out appends each turn's tokens and never "
            "re-renders the past, so training would drift from what the model saw; use a "
            "template that renders earlier turns the same whatever follows (ChatML / Qwen2.5 "
            "style, tephra.episodes.agent.TOOL_CHAT_TEMPLATE), e.g. set tokenizer.chat_template"
        )

    def append_ids(
        self, messages: list[dict], stop_text: str | None, images: list[list[int]] | None = None
    ) -> list[int]:
        """`append_text` as token ids (tokenised on its own: see module docstring).

        Tool output is data: text in a message that spells a control token of the tokenizer
        (`<|im_end|>`, `<|im_start|>`, `<tool_call>`, any added token) is tokenised as plain
        text, never as that token, so a tool cannot forge turns. Such messages are rendered
        with a placeholder and their text is spliced in, tokenised on its own. `images`: the
        token ids of each image the messages show (already expanded by the processor), put
        in place of the `IMAGE_MARKER`s, in order (the caller checks that the counts match)."""
        controls = self.control_texts()
        if not images and not any(
            isinstance(m.get("content"), str) and any(t in m["content"] for t in controls)
            for m in messages
        ):
            return self.encode(self.append_text(messages, stop_text))
        pending = list(images or [])
        marks = [f"TEPHRA_TOOL_CONTENT_{i}_SENTINEL" for i in range(len(messages))]
        text = self.append_text(
            [{**m, "content": mark} for m, mark in zip(messages, marks)], stop_text
        )
        ids: list[int] = []
        for message, mark in zip(messages, marks):
            before, found, text = text.partition(mark)
            if not found:
                raise ConfigError(
                    "agent loop: the chat template changes tool message content "
                    "(a placeholder did not survive rendering)"
                )
            ids += self.encode(before)
            content = str(message.get("content", ""))
            if not images:
                ids += self.encode_plain(content)
                continue
            pieces = content.split(IMAGE_MARKER)
            ids += self.encode_plain(pieces[0])
            for piece in pieces[1:]:
                ids += pending.pop(0) + self.encode_plain(piece)
        return ids + self.encode(text)

    def control_texts(self) -> list[str]:
        """The strings of the tokenizer's added tokens (special or not)."""
        if not hasattr(self, "_controls"):
            self._controls = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True)
        return self._controls

    def encode_plain(self, text: str) -> list[int]:
        """`text` as ordinary tokens: every occurrence of an added token's string is cut after
        its first character, so no piece can match it, and the pieces are tokenised apart."""
        cuts = sorted({at + 1 for t in self.control_texts() if t for at in _occurrences(text, t)})
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]
        return [
            i for piece in pieces for i in self.tokenizer.encode(piece, add_special_tokens=False)
        ]


def _occurrences(text: str, needle: str) -> list[int]:
    found, at = [], text.find(needle)
    while at >= 0:
        found.append(at)
        at = text.find(needle, at + 1)
    return found
