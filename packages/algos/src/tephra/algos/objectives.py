"""Engine-facing loss objects: `loss_fn(outputs, batch) -> (loss, metrics)`.

`outputs` and `batch` are mappings of str -> tensor (TensorDicts at runtime; only `x[key]`
and `key in x.keys()` are used). Every per-token tensor is [batch, seq] aligned with
input_ids. The loss returned is this micro-batch's CONTRIBUTION to the step's loss: it is
divided by the global normalisers `batch["global_token_count"][0]` /
`batch["global_seq_count"][0]` that the engine sets, so the sum over micro-batches and ranks
is the full-batch loss. Metrics are floats about this micro-batch (engines average them).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tephra.algos.aggregation import aggregate_loss
from tephra.algos.config import ActorObjectiveConfig, CriticObjectiveConfig
from tephra.algos.errors import InputError
from tephra.algos.importance_sampling import truncated_importance_weights
from tephra.algos.inputs import check_same_shape
from tephra.algos.kl import kl_penalty
from tephra.algos.masked import masked_mean
from tephra.algos.policy_losses import POLICY_LOSSES, policy_aggregation, weigh_policy_loss
from tephra.algos.value_loss import clipped_value_loss
from tephra.core.metrics import Share

Tensors = Mapping[str, torch.Tensor]


def _need(mapping: Tensors, key: str, where: str, why: str) -> torch.Tensor:
    if key not in mapping.keys():
        raise InputError(f"{where}[{key!r}] is missing: {why}")
    return mapping[key]


def _normalisers(batch: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    why = (
        "engines set it on every micro-batch (the step's total); without an engine use "
        "tephra.algos.global_normalisers(masks)"
    )
    return (
        _need(batch, "global_token_count", "batch", why)[0],
        _need(batch, "global_seq_count", "batch", why)[0],
    )


class ActorObjective:
    """Policy loss + KL loss - entropy bonus, aggregated with global normalisers:

        loss = agg(w * L_pg) - entropy_coeff * agg(H) + kl_loss_coef * agg(KL(pi || pi_ref))

    L_pg the per-token policy loss `config.policy_loss`, w the truncated importance weights
    (1 when `tis_level` is None) times batch["rollout_is_weights"] when present (the
    controller's rollout correction, `tephra.algos.rollout_correction`), agg =
    `config.loss_agg_mode`, except for a policy loss that fixes its own aggregation
    (`geo_mean`: per sequence, its weights a per-sequence geometric mean), as in
    `compute_policy_loss` and in verl.
    Reads outputs["log_probs"] (and outputs["entropy"] when present or needed),
    batch["old_log_probs"], ["advantages"], ["response_mask"], ["global_token_count"],
    ["global_seq_count"], and ["ref_log_probs"] (use_kl_loss), ["rollout_log_probs"] (tis),
    ["teacher_log_probs"] (distill_loss_coef: + coef * agg(KL(pi || teacher)), on-policy
    distillation as a loss term).
    """

    def __init__(self, config: ActorObjectiveConfig | None = None) -> None:
        self.config = config if config is not None else ActorObjectiveConfig()
        self._policy_loss = POLICY_LOSSES.get(self.config.policy_loss)
        self._pg_aggregation = policy_aggregation(
            self.config.policy_loss, self.config.loss_agg_mode
        )

    def __call__(self, outputs: Tensors, batch: Tensors) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        log_probs = _need(
            outputs,
            "log_probs",
            "outputs",
            "the engine's forward must return per-token log-probs of the response",
        )
        old = _need(
            batch,
            "old_log_probs",
            "batch",
            "recompute them with engine.forward "
            "before the update (or copy log_probs.detach() when fully on-policy)",
        )
        adv = _need(batch, "advantages", "batch", "run tephra.algos.compute_advantages first")
        mask = _need(batch, "response_mask", "batch", "1 where a token is trained on")
        check_same_shape(log_probs=log_probs, old_log_probs=old, advantages=adv, response_mask=mask)
        tokens, seqs = _normalisers(batch)

        def agg(mat: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(
                mat,
                mask,
                cfg.loss_agg_mode,
                global_token_count=tokens,
                global_seq_count=seqs,
                norm_constant=cfg.loss_agg_norm_constant,
            )

        loss_mat, pg_metrics = self._policy_loss(log_probs, old, adv, mask, cfg.policy)
        metrics = {f"actor/{k}": v for k, v in pg_metrics.items()}
        weights = None
        if cfg.tis_level is not None:
            rollout = _need(
                batch,
                "rollout_log_probs",
                "batch",
                f"actor.tis_level={cfg.tis_level!r} needs the rollout engine's "
                f"log-probs; set tis_level=None or return them from the rollout",
            )
            weights, tis_metrics = truncated_importance_weights(
                old, rollout, mask, level=cfg.tis_level, threshold=cfg.tis_threshold
            )
            metrics.update({f"actor/{k}": v for k, v in tis_metrics.items()})
        if "rollout_is_weights" in batch.keys():  # computed once per step on the whole batch
            step_weights = batch["rollout_is_weights"]
            weights = step_weights if weights is None else weights * step_weights
        loss_mat = weigh_policy_loss(cfg.policy_loss, loss_mat, weights, mask)
        # the policy term takes the loss's own aggregation where it fixes one (geo_mean);
        # the entropy and KL terms below take loss_agg_mode
        pg_loss = aggregate_loss(
            loss_mat,
            mask,
            self._pg_aggregation,
            global_token_count=tokens,
            global_seq_count=seqs,
            norm_constant=cfg.loss_agg_norm_constant,
        )
        loss = pg_loss
        metrics["actor/pg_loss"] = Share(float(pg_loss.detach()))

        has_entropy = "entropy" in outputs.keys()
        if cfg.entropy_coeff != 0 and not has_entropy:
            raise InputError(
                f"outputs['entropy'] is missing but actor.entropy_coeff={cfg.entropy_coeff}; "
                f"have the engine compute entropy, or set entropy_coeff=0"
            )
        if has_entropy:
            entropy = outputs["entropy"]
            metrics["actor/entropy"] = float(masked_mean(entropy.detach(), mask))
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * agg(entropy)

        if cfg.use_kl_loss:
            ref = _need(
                batch,
                "ref_log_probs",
                "batch",
                "actor.use_kl_loss=True needs the "
                "reference policy's log-probs; compute them or set use_kl_loss=False",
            )
            kl = kl_penalty(log_probs, ref, cfg.kl_loss_type)
            kl_loss = agg(kl)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = Share(float(kl_loss.detach()))
            metrics["actor/kl_mean"] = float(masked_mean(kl.detach(), mask))

        if cfg.distill_loss_coef != 0:
            teacher = _need(
                batch,
                "teacher_log_probs",
                "batch",
                f"actor.distill_loss_coef={cfg.distill_loss_coef} needs the teacher's "
                "log-probs of the sampled tokens; configure a teacher or set it to 0",
            )
            check_same_shape(log_probs=log_probs, teacher_log_probs=teacher)
            rkl = kl_penalty(log_probs, teacher, cfg.distill_loss_type)
            distill_loss = agg(rkl)
            loss = loss + cfg.distill_loss_coef * distill_loss
            metrics["actor/distill_loss"] = Share(float(distill_loss.detach()))
        return loss, metrics


class CriticObjective:
    """Clipped value loss, aggregated with global normalisers:
        loss = agg(0.5 * max((V - R)^2, (V_clip - R)^2))     (see `value_loss`)
    Reads outputs["values"], batch["values"] (old values), ["returns"], ["response_mask"],
    ["global_token_count"], ["global_seq_count"].
    """

    def __init__(self, config: CriticObjectiveConfig | None = None) -> None:
        self.config = config if config is not None else CriticObjectiveConfig()

    def __call__(self, outputs: Tensors, batch: Tensors) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        values = _need(
            outputs,
            "values",
            "outputs",
            "the critic engine (model.role='value') must return per-token values",
        )
        old = _need(batch, "values", "batch", "the critic's values at rollout time")
        returns = _need(batch, "returns", "batch", "run tephra.algos.compute_advantages first")
        mask = _need(batch, "response_mask", "batch", "1 where a token is trained on")
        tokens, seqs = _normalisers(batch)
        loss_mat, vf_metrics = clipped_value_loss(values, old, returns, mask, cfg.cliprange_value)
        loss = aggregate_loss(
            loss_mat,
            mask,
            cfg.loss_agg_mode,
            global_token_count=tokens,
            global_seq_count=seqs,
            norm_constant=cfg.loss_agg_norm_constant,
        )
        metrics = {f"critic/{k}": v for k, v in vf_metrics.items()}
        metrics["critic/vf_loss"] = Share(float(loss.detach()))
        return loss, metrics
