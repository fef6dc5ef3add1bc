"""The MoE routers whose train-mode forward draws random numbers, kept deterministic while
the engine trains.

transformers' PhiMoE router (SparseMixer) samples its experts in train mode (Gumbel noise
among the experts within its jitter of the top score) and multiplies the routing gradient by
a random mask (Heun's third-order estimate); Mixtral, MiniMax, MiniMax-M2 and DBRX multiply
the router's input by uniform noise in train mode when their config sets
`router_jitter_noise` / `moe_jitter_eps`. In RL that makes a training step's routing differ
from the routing the old and reference log-probs came from (the importance ratio is not 1 at
the sampling policy) and the step a draw no other run reproduces. engine=fsdp therefore runs
these modules in eval mode while it trains: the top-k by score, and the plain autograd
gradient of that deterministic forward (the softmax gates' own gradient; the family matrix
checks it against a plain transformers forward in eval mode and by finite differences). It
differs from these models' pre-training recipe, which used the noise as a regulariser.
"""

from __future__ import annotations

from torch import nn

NOISE_ATTRIBUTES = ("jitter_noise", "router_jitter_noise", "input_jitter_noise", "moe_jitter_eps")
"""The attributes transformers' routers and MoE blocks keep their train-mode noise in (set
from the config; a module with one reads `self.training` to decide whether to draw)."""


def noisy_routers(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` whose own forward draws routing noise in train mode."""
    return [m for m in model.modules() if any(a in vars(m) for a in NOISE_ATTRIBUTES)]


def hold_deterministic(modules: list[nn.Module]) -> None:
    """Put `modules` (and only them, not their children) in eval mode, whatever mode the
    model around them is in: called after each `train()` of the model."""
    for module in modules:
        module.training = False
