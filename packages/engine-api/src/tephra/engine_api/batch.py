"""The batch convention: field names and layouts on `tensordict.TensorDict`.

Padded layout (what engines receive and loss functions see), batch size `[B]`:
    input_ids       int64 [B, T]  prompt then response (then tool turns...), padding where
                                  attention_mask is 0 (left or right)
    attention_mask  int64 [B, T]  1 for real tokens
    position_ids    int64 [B, T]  optional; 0, 1, 2... over the real tokens if absent
    response_mask   int64 [B, T]  1 where the token is trained on (model-generated tokens;
                                  0 for prompt, tool output and padding). Never 1 at a
                                  sequence's first real token (nothing predicts it).
Per-token float fields, aligned with `input_ids` (position t is about token t):
    old_log_probs, ref_log_probs, rollout_log_probs, advantages, returns, values,
    token_rewards
Per-sample fields `[B]`: uid (int64 group id: samples of one prompt share it), rewards.
Set by engines on micro-batches: global_token_count, global_seq_count (float32 `[B]`).

Packed layout (padding-free, built inside engines), batch size `[]`:
    input_ids, position_ids, response_mask and every per-token field: `[N]` (N real tokens)
    cu_seqlens int64 [B + 1]: sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1]
Position ids restart at 0 for each sequence; that is how models see the boundaries.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tephra.engine_api.errors import BatchError

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
RESPONSE_MASK = "response_mask"
OLD_LOG_PROBS = "old_log_probs"
REF_LOG_PROBS = "ref_log_probs"
ROLLOUT_LOG_PROBS = "rollout_log_probs"
ADVANTAGES = "advantages"
RETURNS = "returns"
VALUES = "values"
TOKEN_REWARDS = "token_rewards"
UID = "uid"
REWARDS = "rewards"
CU_SEQLENS = "cu_seqlens"
GLOBAL_TOKEN_COUNT = "global_token_count"
GLOBAL_SEQ_COUNT = "global_seq_count"
LEFT_OUT_TOKENS = "left_out_token_count"
"""Optional `[B]` column: response tokens of rows the caller left out of this rank's batch
(rows that add nothing to the gradient, e.g. zero-advantage rows) that still count in the
step's normalisers. Summed over the rows: put the count on one row, zeros elsewhere."""
LEFT_OUT_SEQS = "left_out_seq_count"
"""Optional `[B]` column: sequences left out, as `LEFT_OUT_TOKENS`."""
KEEP_TOGETHER = "keep_together"
"""Optional int64 `[B]` column: consecutive rows with the same value form one unit that no
split cuts (micro-batches, data-parallel shares, mini-batches): a loss that compares rows
with each other (SPIN's chosen / rejected pair) sees the whole unit in one micro-batch."""

ROUTED_EXPERTS = "routed_experts"
"""Optional `[B, T, moe_layers, top_k]` int64 field of a mixture-of-experts model: the
experts the rollout's router chose for each token at each MoE layer (model order), -1 where
nothing was recorded (padding; a sequence's last token, which no forward pass saw). An
engine that replays routes sends each recorded token to these experts, with gates
recomputed from its own router logits at them; unrecorded tokens take the engine's own
top-k."""

REQUIRED_FIELDS = (INPUT_IDS, ATTENTION_MASK, RESPONSE_MASK)


def make_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    **fields: torch.Tensor,
) -> TensorDict:
    """A validated padded batch; position ids are filled in when not given."""
    batch = TensorDict(
        {
            INPUT_IDS: input_ids,
            ATTENTION_MASK: attention_mask,
            RESPONSE_MASK: response_mask,
            **fields,
        },
        batch_size=[input_ids.shape[0]],
    )
    if POSITION_IDS not in batch.keys():
        batch[POSITION_IDS] = positions_from_mask(attention_mask)
    validate_batch(batch)
    return batch


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over real tokens (left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def validate_batch(batch: TensorDict, required: tuple[str, ...] = REQUIRED_FIELDS) -> None:
    """Raise `BatchError` naming the field and the fix for anything an engine cannot use."""
    if not isinstance(batch, TensorDict):
        raise BatchError(f"a batch must be a tensordict.TensorDict, got {type(batch).__name__}")
    keys = set(batch.keys())
    missing = [k for k in required if k not in keys]
    if missing:
        raise BatchError(
            f"batch is missing field(s) {missing}; it has {sorted(keys)}. "
            "See tephra.engine_api.batch for the convention."
        )
    ids = batch[INPUT_IDS]
    if ids.dim() != 2:
        raise BatchError(f"batch['input_ids'] must be [batch, seq], got shape {list(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise BatchError(f"batch['input_ids'] must hold integer token ids, got {ids.dtype}")
    for key in keys:
        value = batch[key]
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape != ids.shape:
            raise BatchError(
                f"batch[{key!r}] has shape {list(value.shape)} but input_ids has "
                f"{list(ids.shape)}; per-token fields must align with input_ids"
            )
    attn = batch[ATTENTION_MASK].bool()
    resp = batch[RESPONSE_MASK].bool()
    if (resp & ~attn).any():
        row = int((resp & ~attn).any(-1).nonzero()[0])
        raise BatchError(f"row {row}: response_mask is 1 on a padding position (attention_mask 0)")
    first = attn.long().argmax(-1)
    starts_trained = resp.gather(1, first[:, None]).squeeze(1) & attn.any(-1)
    if starts_trained.any():
        row = int(starts_trained.nonzero()[0])
        raise BatchError(
            f"row {row}: response_mask is 1 on the sequence's first token, which nothing "
            "predicts; a sequence must start with at least one prompt token"
        )
    if not attn.any(-1).all():
        row = int((~attn.any(-1)).nonzero()[0])
        raise BatchError(f"row {row}: attention_mask is all 0 (an empty sequence)")
    if ids.numel() and (ids[attn] < 0).any():
        raise BatchError("batch['input_ids'] holds negative token ids on real positions")


def sequence_lengths(batch: TensorDict) -> torch.Tensor:
    """Real tokens per sequence, `[B]`."""
    attn: torch.Tensor = batch[ATTENTION_MASK]
    return attn.long().sum(-1)


def pack(batch: TensorDict) -> TensorDict:
    """Padded `[B, T]` -> packed `[N]` (drop padding, keep order, add `cu_seqlens`).

    Per-token fields are packed, per-sample fields (`[B]`) are kept as they are.
    """
    attn = batch[ATTENTION_MASK].bool()
    lengths = attn.sum(-1)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    out = {}
    for key in batch.keys():
        value = batch[key]
        if key == ATTENTION_MASK:
            continue
        if value.dim() >= 2 and value.shape[:2] == attn.shape:
            out[key] = value[attn]
        else:
            out[f"per_sample.{key}"] = value
    if POSITION_IDS not in out:
        out[POSITION_IDS] = positions_from_mask(batch[ATTENTION_MASK])[attn]
    else:
        # restart at 0 per sequence, whatever offsets the padded ids carried
        pos = out[POSITION_IDS]
        out[POSITION_IDS] = pos - torch.repeat_interleave(pos[cu[:-1]], lengths)
    out[CU_SEQLENS] = cu
    return TensorDict(out, batch_size=[])


def unpack(values: torch.Tensor, attention_mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Packed per-token `[N, ...]` -> padded `[B, T, ...]` laid out as `attention_mask`."""
    attn = attention_mask.bool()
    out = values.new_full((*attn.shape, *values.shape[1:]), fill)
    out[attn] = values
    return out


def trim_padding(batch: TensorDict) -> TensorDict:
    """Drop columns that are padding in every row (after slicing out a micro-batch); columns
    that are not tensors (the rows' images) are kept as they are."""
    attn = batch[ATTENTION_MASK].bool()
    cols = attn.any(0).nonzero()
    if len(cols) == 0:
        return batch
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    if lo == 0 and hi == attn.shape[1]:
        return batch
    seq_len = attn.shape[1]
    trimmed = batch.apply(
        lambda t: t[:, lo:hi] if t.dim() >= 2 and t.shape[1] == seq_len else t,
        batch_size=batch.batch_size,
    )
    assert trimmed is not None  # apply returns None only when it writes in place (out=)
    # apply leaves out non-tensor columns: without this a micro-batch lost its images
    # whenever none of its rows was as long as the batch
    return trimmed.update(batch.exclude(*trimmed.keys(include_nested=True, leaves_only=True)))


def microbatch_cost(lengths: list[int], packed: bool) -> int:
    """Tokens a micro-batch of these sequence lengths costs under the budget."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def units(batch: TensorDict) -> list[range]:
    """The rows in units no split may cut (`KEEP_TOGETHER`): each row alone when the column
    is absent."""
    n = batch.batch_size[0]
    if KEEP_TOGETHER not in batch.keys():
        return [range(i, i + 1) for i in range(n)]
    ids = batch[KEEP_TOGETHER].tolist()
    out: list[range] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or ids[i] != ids[start]:
            out.append(range(start, i))
            start = i
    return out


def split_by_token_budget(
    batch: TensorDict, max_tokens: int, packed: bool, field_name: str = "max_tokens_per_microbatch"
) -> list[TensorDict]:
    """Cut a padded batch into consecutive micro-batches that each fit `max_tokens`.

    The order of samples is kept (so results do not depend on the split), and a unit of
    rows (`KEEP_TOGETHER`) is never cut. Packed cost is the number of real tokens; padded
    cost is rows x longest row. Each micro-batch is trimmed of all-padding columns.
    """
    lengths = sequence_lengths(batch).tolist()
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i = too_long[0]
        raise BatchError(
            f"sequence {i} has {lengths[i]} tokens, more than micro_batch.{field_name}="
            f"{max_tokens}; raise the budget or shorten prompts/responses"
        )
    groups: list[list[int]] = [[]]
    for unit in units(batch):
        rows = list(unit)
        if microbatch_cost([lengths[j] for j in rows], packed) > max_tokens:
            raise BatchError(
                f"rows {rows[0]}..{rows[-1]} must share a micro-batch ({KEEP_TOGETHER}) but "
                f"together cost more than micro_batch.{field_name}={max_tokens} tokens; "
                "raise the budget or shorten prompts/responses"
            )
        current = [lengths[j] for j in groups[-1]]
        if (
            groups[-1]
            and microbatch_cost(current + [lengths[j] for j in rows], packed) > max_tokens
        ):
            groups.append([])
        groups[-1].extend(rows)
    return [trim_padding(batch[g[0] : g[-1] + 1]) for g in groups if g]


def halve(batch: TensorDict) -> tuple[TensorDict, TensorDict] | None:
    """`batch` cut in two at the unit boundary nearest its middle (`KEEP_TOGETHER`), both
    trimmed of padding; None when it is one unit."""
    bounds = [u.start for u in units(batch)][1:]
    if not bounds:
        return None
    cut = min(bounds, key=lambda b: (abs(2 * b - batch.batch_size[0]), b))
    return trim_padding(batch[:cut]), trim_padding(batch[cut:])


def set_global_normalisers(
    micro_batches: list[TensorDict], process_group: torch.distributed.ProcessGroup | None = None
) -> tuple[float, float]:
    """Write the step's response-token and sequence counts into every micro-batch.

    Counts are summed over `micro_batches` (with the rows left out that `LEFT_OUT_TOKENS` /
    `LEFT_OUT_SEQS` record) and, when torch.distributed is initialised, over the ranks of
    `process_group` (the data-parallel group). Returns the two counts.
    """
    tokens = sum(
        float(mb[RESPONSE_MASK].sum()) + _column_sum(mb, LEFT_OUT_TOKENS) for mb in micro_batches
    )
    seqs = sum(
        float((mb[RESPONSE_MASK].sum(-1) > 0).sum()) + _column_sum(mb, LEFT_OUT_SEQS)
        for mb in micro_batches
    )
    counts = torch.tensor([tokens, seqs], dtype=torch.float64)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts, group=process_group)
    tokens, seqs = float(counts[0]), float(counts[1])
    for mb in micro_batches:
        n = mb.batch_size[0]
        mb[GLOBAL_TOKEN_COUNT] = torch.full((n,), max(tokens, 1.0))
        mb[GLOBAL_SEQ_COUNT] = torch.full((n,), max(seqs, 1.0))
    return tokens, seqs


def _column_sum(mb: TensorDict, key: str) -> float:
    return float(mb[key].sum()) if key in mb.keys() else 0.0


def label_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """Shift `[.., T]` masks left by one: hidden state t predicts token t+1.

    Engines compute the log-prob of token t from the hidden state at t-1; this gives, for
    each hidden-state position, whether the next token is trained.
    """
    out = torch.zeros_like(response_mask)
    out[..., :-1] = response_mask[..., 1:]
    return out


def align_to_tokens(per_hidden: torch.Tensor) -> torch.Tensor:
    """Shift `[.., T]` values right by one: a value computed at hidden state t-1 is about
    token t. Position 0 gets 0."""
    out = torch.zeros_like(per_hidden)
    out[..., 1:] = per_hidden[..., :-1]
    return out
