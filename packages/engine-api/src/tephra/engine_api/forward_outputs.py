"""The optional per-token outputs a caller may request from `Engine.forward`, and their check."""

from __future__ import annotations

from collections.abc import Collection

from tephra.engine_api.errors import ConfigError

EXTRA_FORWARD_OUTPUTS: dict[str, str] = {
    "sum_pi_squared": "sum over the vocabulary of p(v | tokens_<t)^2 of the (temperature-"
    "scaled) policy distribution token_t was drawn from; float32, policy engines only (the "
    "optimal-token-baseline advantage estimators read it)",
}
"""Name -> meaning of each output `Engine.forward` computes only when asked in `extra_outputs`."""


def check_extra_outputs(extra_outputs: Collection[str], role: str) -> tuple[str, ...]:
    """`extra_outputs` as a tuple, or a ConfigError naming an unknown output or one the
    engine's `role` cannot give (every extra output is a policy output today)."""
    names = tuple(extra_outputs)
    unknown = [n for n in names if n not in EXTRA_FORWARD_OUTPUTS]
    if unknown:
        raise ConfigError(
            f"Engine.forward(extra_outputs={list(names)}): {unknown} are not extra outputs; "
            f"choose from {sorted(EXTRA_FORWARD_OUTPUTS)}"
        )
    if names and role != "policy":
        raise ConfigError(
            f"Engine.forward(extra_outputs={list(names)}) asks a {role!r} engine for policy "
            "outputs; only an engine with model.role='policy' computes them"
        )
    return names
