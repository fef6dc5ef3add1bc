"""The one per-sample type, from the backend that generates it to the training batch, and its
padder.

A `Sample` is one response to one prompt: a plain generation (the backend fills the token
fields), a multi-turn episode (the episode fills the transcript and tool counts) or a scored
sample (the trainer fills `reward`, a `RewardResult`: the one score type, from the scorer that
makes it to the batch). Its token fields, one entry per response token:

    response_ids    [R]  every token after the prompt: model turns and tool turns, in order
    response_mask   [R]  1 on model-generated tokens (trained), 0 on tool/user tokens
    log_probs       [R]  the rollout log-prob of each generated token, 0.0 on tool tokens
                         (None when the backend was not asked for them)
    token_versions  [R]  the weight version that produced each token (None: untagged)

`to_batch` pads a list of them into the layout of `tephra.engine_api.batch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from tensordict import TensorDict

from tephra.engine_api.batch import make_batch
from tephra.engine_api.errors import ConfigError
from tephra.engine_api.multimodal import MULTIMODAL, MultimodalInputs, multimodal_column


@dataclass
class RewardResult:
    """The score of one response: what a scorer produces (`tephra.episodes.rewards`), what a
    worker hands back, and what a `Sample` carries (`Sample.reward`)."""

    score: float
    """The scalar reward (0.0 when the scorer failed and errors are not raised)."""
    extras: dict[str, float] = field(default_factory=dict)
    """Extra numeric metrics a scorer returned beside "score" (e.g. {"acc": 1.0}, or a reward
    function's components {"format": 1.0, "accuracy": 0.0}, which GDPO's
    `algorithm.advantage.gdpo_reward_keys` picks)."""
    error: str | None = None
    """`ExceptionType: message` of the scorer's exception, or None when it succeeded."""
    clipped: bool = False
    """Whether `reward.clip` moved `score` into its range."""


@dataclass
class Sample:
    """One response to one prompt (see the module docstring for the token fields)."""

    prompt_ids: list[int] = field(default_factory=list)
    """The prompt's token ids (empty in what `Rollout.agenerate` returns: its caller holds
    the prompt)."""
    response_ids: list[int] = field(default_factory=list)
    """Every token after the prompt (a stop token, when one ended a turn, included)."""
    response_mask: list[int] | None = None
    """1 on tokens the model generated (trained), 0 on tokens a tool wrote; None (the
    default) means every response token is the model's and is set to all ones."""
    log_probs: list[float] | None = None
    """The rollout engine's log-prob of each response token (0 on tool tokens); None when the
    sampling settings asked for none (`SamplingParams.logprobs=False`)."""
    finish_reason: str = "stop"
    """`stop` (a stop/EOS token, or an answer without a tool call), `length` (max_tokens,
    the model length or the response budget), `max_turns` (an episode's last allowed turn
    still called a tool), `image_token` (ended before an image placeholder it sampled), `done`
    (an environment ended the episode), `agent_error` (a black-box agent raised), or
    `tool_timeout` / `turn_timeout` / `trajectory_timeout` (a deadline of the episode
    expired)."""
    text: str = ""
    """What the reward scores: the decoded response, or the last assistant message of a
    multi-turn episode (earlier turns are tool calls)."""
    reward: RewardResult = field(default_factory=lambda: RewardResult(0.0))
    """Its score (`reward.score`; 0.0 until the trainer sets it from the scorer's
    `RewardResult`, and when the scorer failed: see `reward.error`)."""
    sample_id: str = ""
    """Names the sample's prompt item (tool instances, the rollout session)."""
    num_turns: int = 1
    """Model turns (generate calls)."""
    tool_calls: int = 0
    """Tool calls answered with a tool message (run, malformed or over the per-turn cap)."""
    tool_errors: int = 0
    """Tool calls that returned an error (bad JSON, unknown tool, the tool's own error)."""
    tool_rewards: dict[str, float] = field(default_factory=dict)
    """`Tool.calc_reward` of each tool the episode used."""
    env_reward: float | None = None
    """The reward an episode's environment assigned (its per-turn rewards summed; their list
    is `extra_info["turn_rewards"]`, and `extra_info["turn_ends"]` the index in `response_ids`
    of each turn's last generated token, where the trainer puts that turn's reward), or 0.0 for a trajectory cut by a deadline under the
    `zero` policy. When set it is the sample's score and the reward scorer is not called;
    None (plain generation, an environment that leaves scoring to the scorer) scores the
    text as usual."""
    dropped: bool = False
    """Cut by a deadline under the `drop` policy: its response mask is all zeros (it trains
    nothing) and the trainer takes it out of its prompt's group (the group's baseline and
    scale come from the others)."""
    weight_version: int = 0
    """Version of the weights that generated it: the number of RL steps (weight syncs)
    those weights had been updated by; the trainer sets it. The version lag of a trained
    sample is the trainer's version (the steps completed before the update) minus this."""
    multimodal: MultimodalInputs | None = None
    """The prompt's images (pixel values and grids), None for a text prompt."""
    token_versions: list[int] | None = None
    """Weight version of each response token, when the backend's owner numbers its weights
    (partial rollout: a sample interrupted by a weight update continues under the new
    version; tool tokens take the version of the model turn they answer); None when any
    turn was untagged. `weight_version` is then its oldest entry."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """A multi-turn episode's transcript: the prompt's messages, then assistant and tool
    messages (empty for a plain generation)."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """What an episode recorded beside the tokens: `tool_metrics` (summed per tool and
    metric), an environment's `turn_rewards` / `turn_ends`, `agent_error`, ... (empty for a
    plain generation). The prompt's own data (its `extra_info` among them) stays on the
    prompt (`tephra.episodes.prompt.Prompt`), which the caller holds in the same order."""
    prompt_index: int = 0
    """Index of the sample's prompt in the `generate` call (or step) that made it."""
    routed_experts: torch.Tensor | None = None
    """`[prompt + response tokens, moe_layers, top_k]` int64: the experts the rollout's
    routers chose for each token (`RolloutConfig.record_routes`), None when not recorded."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if self.response_mask is None:
            self.response_mask = [1] * n
        if (
            len(self.response_mask) != n
            or (self.log_probs is not None and len(self.log_probs) != n)
            or (self.token_versions is not None and len(self.token_versions) != n)
        ):
            raise ConfigError(
                f"sample {self.sample_id!r}: response_ids ({n}), response_mask "
                f"({len(self.response_mask)}), log_probs (when set) and token_versions (when "
                "set) must have one entry per response token"
            )

    @property
    def generated_tokens(self) -> int:
        """Response tokens the model generated (the trained ones)."""
        return sum(cast(list[int], self.response_mask))  # filled by __post_init__


AGENT_COLUMNS = ("num_turns", "tool_calls", "tool_errors")


def to_batch(
    samples: Sequence[Sample],
    pad_token_id: int,
    *,
    agent_stats: bool = False,
    prompt_index: Sequence[int] | None = None,
    uids: Sequence[int] | None = None,
) -> TensorDict:
    """The samples in the padded layout of `tephra.engine_api.batch`, batch size [B]:

    input_ids          int64 [B, P + R]  prompt left-padded to P = longest prompt, then the
                                         response right-padded to R = longest response
    attention_mask     int64 [B, P + R]  1 on prompt and response tokens (tool tokens too: the
                                         model reads them)
    position_ids       int64 [B, P + R]  0, 1, 2, ... over real tokens
    response_mask      int64 [B, P + R]  1 on model-generated tokens only
    rollout_log_probs  float32 [B, P + R] log-prob of token t at position t, 0 elsewhere (when
                                         every sample has log-probs)
    prompt_index       int64 [B]         `prompt_index` when given, else each sample's own
    num_turns, tool_calls, tool_errors   int64 [B]   (`agent_stats`)
    tool_rewards       float32 [B]       sum of each sample's `tool_rewards` (`agent_stats`)
    uid                int64 [B]         group id of each sample (GRPO groups), when `uids` given
    multimodal                           the samples' images (`MULTIMODAL`), when any has some
    routed_experts     int64 [B, P + R, L, k]  each token's experts per MoE layer, -1 on
                                         padding (when every sample has them)
    """
    if not samples:
        raise ConfigError("to_batch: no samples; give at least one")
    num = len(samples)
    for name, column in (("prompt_index", prompt_index), ("uids", uids)):
        if column is not None and len(column) != num:
            raise ConfigError(
                f"to_batch: {len(column)} {name} for {num} samples; give one per sample"
            )
    p_len = max(len(s.prompt_ids) for s in samples)
    r_len = max(max(len(s.response_ids) for s in samples), 1)
    ids = torch.full((num, p_len + r_len), pad_token_id, dtype=torch.int64)
    attn = torch.zeros((num, p_len + r_len), dtype=torch.int64)
    resp = torch.zeros_like(attn)
    logp = torch.zeros((num, p_len + r_len), dtype=torch.float32)
    with_log_probs = all(s.log_probs is not None for s in samples)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, p_len - p : p_len] = torch.tensor(s.prompt_ids, dtype=torch.int64)
        attn[i, p_len - p : p_len + r] = 1
        if r:
            ids[i, p_len : p_len + r] = torch.tensor(s.response_ids, dtype=torch.int64)
            resp[i, p_len : p_len + r] = torch.tensor(s.response_mask, dtype=torch.int64)
            if with_log_probs:
                logp[i, p_len : p_len + r] = torch.tensor(s.log_probs, dtype=torch.float32)
    index = prompt_index if prompt_index is not None else [s.prompt_index for s in samples]
    fields: dict[str, Any] = {"prompt_index": torch.tensor(list(index), dtype=torch.int64)}
    if with_log_probs:
        fields["rollout_log_probs"] = logp
    if agent_stats:
        for key in AGENT_COLUMNS:
            fields[key] = torch.tensor([getattr(s, key) for s in samples], dtype=torch.int64)
        fields["tool_rewards"] = torch.tensor(
            [sum(s.tool_rewards.values()) for s in samples], dtype=torch.float32
        )
    if uids is not None:
        fields["uid"] = torch.tensor(list(uids), dtype=torch.int64)
    if all(s.routed_experts is not None for s in samples):
        fields["routed_experts"] = _routes_column(samples, p_len, r_len)
    batch = make_batch(ids, attn, resp, **fields)
    if any(s.multimodal is not None for s in samples):
        batch[MULTIMODAL] = multimodal_column([s.multimodal for s in samples])
    return batch


def _routes_column(samples: Sequence[Sample], p_len: int, r_len: int) -> torch.Tensor:
    """The samples' `routed_experts` in the batch layout `[B, P + R, L, k]`, -1 on padding."""
    first = samples[0].routed_experts
    assert first is not None
    out = torch.full((len(samples), p_len + r_len, *first.shape[1:]), -1, dtype=torch.int64)
    for i, s in enumerate(samples):
        routes = s.routed_experts
        assert routes is not None
        p, r = len(s.prompt_ids), len(s.response_ids)
        if routes.shape[0] != p + r or routes.shape[1:] != first.shape[1:]:
            raise ConfigError(
                f"sample {i}: routed_experts has shape {list(routes.shape)}, expected "
                f"[{p + r} prompt + response tokens, {', '.join(map(str, first.shape[1:]))}]"
            )
        out[i, p_len - p : p_len + r] = routes
    return out
