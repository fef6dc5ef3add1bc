"""What the loss does about the rollout / trainer mismatch in one step: the old log-probs and
importance weights (`algorithm.rollout_correction`), rejection, the mismatch probe and alarm."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from tephra.algos import ROLLOUT_CORRECTIONS, apply_rollout_correction, rollout_mismatch_metrics
from tephra.core.errors import ConfigError, TephraError


def correct_old_log_probs(
    batch: TensorDict,
    correction: Any,
    recompute: bool,
    compute_log_probs: Callable[[TensorDict], torch.Tensor],
    *,
    probe_rows: int = 0,
    dp_size: int = 1,
    probe_seed: int = 0,
) -> tuple[dict[str, float], int]:
    """Set batch["old_log_probs"] (and ["rollout_is_weights"], and ["rejection_keep"] when
    rejection sampling is on) as `correction` (a tephra.algos.RolloutCorrectionConfig) says;
    returns (`rollout_corr/*` metrics, forward passes run). The trainer's log-probs are
    computed when the mode or rejection needs them or when `recompute` (several mini-batches
    / epochs), unless the mode replaces them (bypass); without them, one mini-batch and epoch
    use the current log-probs (in the worker). The mismatch metrics come whenever the
    trainer's log-probs were computed; otherwise from a probe of `probe_rows` random rows
    (`mismatch_probe`), so every step logs them."""
    meta = ROLLOUT_CORRECTIONS.meta(correction.mode)
    needs_train = meta["needs_train_log_probs"] or bool(correction.rejection)
    passes = 0
    if not meta.get("replaces_old_log_probs") and (recompute or needs_train):
        batch["old_log_probs"] = compute_log_probs(batch)
        passes = 1
    train = batch["old_log_probs"] if passes else None
    if "rollout_log_probs" not in batch.keys():
        if correction.mode != "none" or correction.rejection:
            raise ConfigError(
                f"algorithm.rollout_correction={correction.mode!r} (and "
                "algorithm.rollout_rejection) need the rollout's per-token "
                "log-probs, which this rollout did not return"
            )
        return {}, passes
    if correction.mode == "none" and train is None:
        return mismatch_probe(batch, probe_rows, dp_size, probe_seed, compute_log_probs), passes
    out = apply_rollout_correction(
        correction, batch["rollout_log_probs"], batch["response_mask"], train
    )
    batch["old_log_probs"] = out.old_log_probs
    if out.weights is not None:
        batch["rollout_is_weights"] = out.weights.to(batch["rollout_log_probs"].dtype)
    if out.keep is not None:
        batch["rejection_keep"] = out.keep
    return out.metrics, passes


def mismatch_probe(
    batch: TensorDict,
    rows: int,
    dp_size: int,
    seed: int,
    compute_log_probs: Callable[[TensorDict], torch.Tensor],
) -> dict[str, float]:
    """`rollout_corr/*` mismatch metrics (tephra.algos.rollout_mismatch_metrics) on `rows`
    random rows (rounded to the data-parallel size, at least one per rank), whose trainer
    log-probs are computed for it; {} when `rows` is 0. `rollout_corr/probe_rows` says how
    many. The rows come from `seed`, so a resumed run probes the same ones."""
    n = batch.batch_size[0]
    if rows <= 0 or n == 0:
        return {}
    k = min(n, max(dp_size, rows - rows % dp_size))
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].sort().values
    sub = batch[idx]
    metrics = rollout_mismatch_metrics(
        compute_log_probs(sub), sub["rollout_log_probs"], sub["response_mask"]
    )
    metrics["rollout_corr/probe_rows"] = float(k)
    return metrics


def apply_rejection(batch: TensorDict) -> None:
    """Drop the tokens rejection sampling rejected from batch["response_mask"], after the
    advantages (a rejected sequence's score still counts in its group, as in verl) and before
    the updates."""
    if "rejection_keep" in batch.keys():
        batch["response_mask"] = batch["response_mask"] * batch["rejection_keep"]
        del batch["rejection_keep"]


def check_mismatch_alarm(metrics: dict[str, float], threshold: float | None, step: int) -> None:
    """Raise a MismatchAlarm when `rollout_corr/kl_k3` is over `threshold`."""
    kl = metrics.get("rollout_corr/kl_k3")
    if threshold is None or kl is None or kl <= threshold:
        return
    raise MismatchAlarm(
        f"step {step}: the rollout's log-probs differ from the trainer's by KL {kl:.3g} "
        f"(rollout_corr/kl_k3, mean |gap| {metrics['rollout_corr/log_prob_abs_gap_mean']:.3g} "
        f"nats), over algorithm.mismatch_alarm_kl={threshold}. Likely causes: the rollout "
        f"computes in another dtype than the trainer (rollout.dtype, actor.precision), another "
        f"backend's kernels (rollout.backend), or another chat template or tokenizer than the "
        f"trainer's. Raise the threshold, or correct for it with algorithm.rollout_correction="
        f"tis or algorithm.rollout_rejection"
    )


class MismatchAlarm(TephraError, RuntimeError):
    """The train/rollout mismatch went over `algorithm.mismatch_alarm_kl`."""
