"""Several LoRA training clients on one engine: each client's adapter and optimizer state
are swapped in before its call, through the engine contract alone.

A base model's engine holds one adapter at a time. A client's state (adapter weights,
optimizer moments, step count) is the engine's checkpoint (`save_checkpoint`, which resumes
bitwise); a client's gradients accumulated since its last `optim_step` are not part of a
checkpoint, so the server keeps the batches of those `forward_backward` calls and replays
them after the swap (same weights, same batches: the same gradients).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict import TensorDict

from tephra.apps.serve.losses import LOSSES
from tephra.engine_api.engine import Engine


@dataclass
class ClientState:
    """One training client (one adapter) on a shared engine."""

    model_id: str
    checkpoint: Path
    saved: bool = False
    """Whether `checkpoint` holds this client's state (false until it is first swapped out)."""
    pending: list[tuple[TensorDict, str]] = field(default_factory=list)
    """`forward_backward` batches (and loss names) since the last `optim_step`."""


class SharedEngine:
    """One engine (a base model with adapters of one rank) serving several clients."""

    def __init__(self, engine: Engine, workdir: Path | None = None) -> None:
        self.engine = engine
        self._tmp = tempfile.TemporaryDirectory(prefix="tephra-serve-") if workdir is None else None
        self.workdir = Path(self._tmp.name) if self._tmp else Path(workdir)  # type: ignore[arg-type]
        self.initial = self.workdir / "initial"
        engine.save_checkpoint(self.initial)
        self.clients: dict[str, ClientState] = {}
        self.active: str | None = None

    def add_client(self, model_id: str) -> None:
        self.clients[model_id] = ClientState(model_id, self.workdir / model_id)

    def _swap_out(self) -> None:
        """Keep the active client's state in its checkpoint; the engine then holds none."""
        if self.active is not None:
            previous = self.clients[self.active]
            self.engine.save_checkpoint(previous.checkpoint)
            previous.saved = True
            self.active = None

    def activate(self, model_id: str) -> None:
        """Make `model_id`'s adapter, optimizer state and pending gradients the engine's."""
        if self.active == model_id:
            return
        self._swap_out()
        client = self.clients[model_id]
        self.engine.load_checkpoint(client.checkpoint if client.saved else self.initial)
        # gradients are no part of a checkpoint: recompute the client's pending ones
        with self.engine.train_mode():
            for batch, loss in client.pending:
                self.engine.forward_backward(batch, LOSSES[loss])
        self.active = model_id

    def forward_backward(self, model_id: str, batch: TensorDict, loss: str) -> torch.Tensor:
        """Accumulate `loss`'s gradients on `batch`; returns the `[B, T]` log-probs."""
        self.activate(model_id)
        with self.engine.train_mode():
            self.engine.forward_backward(batch, LOSSES[loss])
        self.clients[model_id].pending.append((batch, loss))
        return self.forward(model_id, batch)

    def forward(self, model_id: str, batch: TensorDict) -> torch.Tensor:
        self.activate(model_id)
        with self.engine.eval_mode():
            out = self.engine.forward(batch)
        log_probs: torch.Tensor = out["log_probs"]
        return log_probs

    def optim_step(
        self,
        model_id: str,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        grad_clip: float,
    ) -> float:
        self.activate(model_id)
        self.engine.set_optimizer_params(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_clip=grad_clip
        )
        with self.engine.train_mode():
            norm = self.engine.optimizer_step()
        self.clients[model_id].pending.clear()
        return norm

    def save_state(self, model_id: str, folder: Path) -> None:
        """Save the client's adapter, optimizer state and step count (the engine's checkpoint)
        in `folder`; gradients of `forward_backward` calls not yet stepped are not saved."""
        self.activate(model_id)
        self.engine.save_checkpoint(folder)

    def load_state(self, model_id: str, folder: Path) -> None:
        """Make the state saved in `folder` the client's, dropping its pending gradients."""
        self._swap_out()
        self.engine.load_checkpoint(folder)
        self.clients[model_id].pending.clear()
        self.active = model_id

    def load_weights_only(self, model_id: str, folder: Path) -> None:
        """Make the adapter saved in `folder` the client's with a fresh optimizer (no moments,
        step count 0: `Engine.load_adapter_weights`), dropping its pending gradients."""
        self.load_state(model_id, folder)
        with self.engine.eval_mode():
            adapter = self.engine.export_adapter_weights()
        self.engine.load_adapter_weights(adapter)

    def weights(self, model_id: str) -> dict[str, torch.Tensor]:
        """The client's merged weights (base + its adapter), Hugging Face names."""
        self.activate(model_id)
        out: dict[str, torch.Tensor] = {}
        with self.engine.eval_mode():
            for bucket in self.engine.export_weights():
                out.update({name: t.detach().clone() for name, t in bucket})
        return out
