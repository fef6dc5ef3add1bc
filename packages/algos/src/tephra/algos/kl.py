"""KL divergence between the policy pi and the reference pi_ref, estimated per token.

Samples x ~ pi; with log-ratio d = log pi(x) - log pi_ref(x), the estimators of
KL(pi || pi_ref) = E_pi[d] are (J. Schulman, "Approximating KL Divergence", 2020):
    k1   d                                 unbiased, high variance, can be negative
    abs  |d|                               biased, >= 0
    k2   d^2 / 2                           biased, >= 0, low variance ("mse")
    k3   exp(-d) - 1 + d                   unbiased, >= 0, low variance ("low_var_kl")
    full sum_v pi(v) (log pi(v) - log pi_ref(v))  exact; needs [batch, seq, vocab] log-probs
Straight-through variants `k1+`, `abs+`, `k2+`, `k3+`: the VALUE of the named estimator
and the GRADIENT of k2. For x ~ pi, E_pi[grad k2(x)] = E_pi[d grad log pi(x)] = grad KL(pi ||
pi_ref) exactly, whereas grad k3 in expectation is grad KL(pi_ref || pi): as a loss term, k3
optimises the wrong direction of KL (Tang & Munos 2025, "On a few pitfalls in KL divergence
gradient estimation for RL"). `full` is exact in value and gradient, so it has no `+` form.

KL is used two ways: as a reward penalty (`apply_kl_penalty`, InstructGPT-style, with a
fixed or adaptive coefficient) and as a loss term (GRPO-style, `ActorObjective`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tephra.algos.errors import InputError
from tephra.algos.inputs import check_same_shape
from tephra.algos.masked import masked_mean, masked_sum
from tephra.algos.registry import Registry

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

K3_MAX = 10.0
"""k3 values are clamped to at most this: one token with a huge log-ratio (exp overflows)
must not dominate the batch; the k2 gradient of `k3+` is not affected by the clamp."""


def straight_through(value: torch.Tensor, grad_from: torch.Tensor) -> torch.Tensor:
    """A tensor equal to `value` whose gradient is the gradient of `grad_from`:
    grad_from - sg(grad_from) + sg(value)."""
    return grad_from - grad_from.detach() + value.detach()


@KL_ESTIMATORS.register("k1")
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log pi_ref (unbiased; Schulman 2020)."""
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("abs")
def kl_abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """|log pi - log pi_ref|."""
    return (log_probs - ref_log_probs).abs()


@KL_ESTIMATORS.register("k2")
def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2 (Schulman 2020)."""
    return 0.5 * (log_probs - ref_log_probs).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1, clamped to [0, K3_MAX]
    (unbiased, low variance; Schulman 2020; the `low_var_kl` of GRPO, Shao et al. 2024)."""
    r = ref_log_probs - log_probs
    return (torch.exp(r.clamp(max=20.0)) - r - 1).clamp(min=0.0, max=K3_MAX)


@KL_ESTIMATORS.register("full")
def kl_full(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """KL(pi || pi_ref) = sum_v pi(v) (log pi(v) - log pi_ref(v)) at every position.
    Inputs are [batch, seq, vocab] normalised log-probs; returns [batch, seq]."""
    if log_probs.dim() != 3 or log_probs.shape != ref_log_probs.shape:
        raise InputError(
            f"KL estimator 'full' needs [batch, seq, vocab] log-probs of the whole vocabulary "
            f"for both policies, got {tuple(log_probs.shape)} and {tuple(ref_log_probs.shape)};"
            f" with per-token log-probs use 'k3+' or 'k1'"
        )
    return (log_probs.exp() * (log_probs - ref_log_probs)).sum(-1)


def _straight_through_variant(value_fn: KLEstimator) -> KLEstimator:
    def estimator(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
        return straight_through(value_fn(log_probs, ref_log_probs), kl_k2(log_probs, ref_log_probs))

    estimator.__name__ = f"{value_fn.__name__}_plus"
    estimator.__doc__ = (
        f"Value of `{value_fn.__name__}`, gradient of k2 (unbiased for grad KL(pi || pi_ref))."
    )
    return estimator


for _name, _fn in (("k1", kl_k1), ("abs", kl_abs), ("k2", kl_k2), ("k3", kl_k3)):
    KL_ESTIMATORS.register(f"{_name}+", _straight_through_variant(_fn))
# verl's names for the same estimators.
KL_ESTIMATORS.register("kl", kl_k1)
KL_ESTIMATORS.register("mse", kl_k2)
KL_ESTIMATORS.register("low_var_kl", kl_k3)
KL_ESTIMATORS.register("low_var_kl+", KL_ESTIMATORS.get("k3+"))
KL_ESTIMATORS.register("kl+", KL_ESTIMATORS.get("k1+"))
# verl's `mse+`: the k2 value with the k2 gradient, i.e. k2 itself
KL_ESTIMATORS.register("mse+", KL_ESTIMATORS.get("k2+"))


def kl_penalty(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token KL estimate [batch, seq] of KL(pi || pi_ref) by the named estimator.

    log_probs, ref_log_probs: [batch, seq] log-probs of the sampled tokens under pi and
    pi_ref ([batch, seq, vocab] full distributions for `full`). Masking is the caller's.
    """
    fn = KL_ESTIMATORS.get(estimator)
    if fn is not kl_full:
        check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs)
    return fn(log_probs, ref_log_probs)


def apply_kl_penalty(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor, coef: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL as a reward penalty (Ziegler et al. 2019; InstructGPT, Ouyang et al. 2022):
        r'[b, t] = r[b, t] - coef * kl[b, t] * m[b, t]

    token_rewards, response_mask, kl: [batch, seq]. Returns the new token rewards and metrics:
    `kl_penalty/kl` (mean over sequences of the per-sequence token-mean KL: what
    `AdaptiveKLController.update` expects), `kl_penalty/kl_seq_sum` (mean per-sequence sum),
    `kl_penalty/coef`.
    """
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask, kl=kl)
    kl = kl.detach()
    penalised = token_rewards - coef * torch.where(response_mask > 0, kl, torch.zeros_like(kl))
    has_tokens = (response_mask > 0).any(dim=-1)
    seq_mean = masked_mean(kl, response_mask, dim=-1)
    seq_sum = masked_sum(kl, response_mask, dim=-1)
    n = has_tokens.sum().clamp(min=1)
    metrics = {
        "kl_penalty/kl": float(seq_mean[has_tokens].sum() / n),
        "kl_penalty/kl_seq_sum": float(seq_sum[has_tokens].sum() / n),
        "kl_penalty/coef": float(coef),
    }
    return penalised, metrics


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise InputError(f"kl_coef={kl_coef!r} must be >= 0")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences"), a proportional controller towards `target_kl`:
        e = clip(current_kl / target_kl - 1, -0.2, 0.2)
        coef <- coef * (1 + e * n_steps / horizon)
    `n_steps` is the number of samples (or steps) since the last update; `horizon` is in the
    same unit.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if init_kl_coef < 0:
            raise InputError(f"init_kl_coef={init_kl_coef!r} must be >= 0")
        if target_kl <= 0:
            raise InputError(f"target_kl={target_kl!r} must be > 0")
        if horizon <= 0:
            raise InputError(f"horizon={horizon!r} must be > 0 (samples or steps)")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
