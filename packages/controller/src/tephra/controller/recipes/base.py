"""The RL step's plug-in points: a recipe is one class that hooks named stages of the step and
asks for engines by role; the step calls every enabled recipe's hooks and names none of them.

The stages, in the order the step runs them (`tephra.controller.loop.trainer.Trainer.train_step`):

    after_generation   the step's samples are in a batch; a recipe may replace the batch
                       (SPIN's chosen / rejected pairs) before it is planned over the ranks
    forward_passes     beside the reference pass: log-probs of the recipe's engines
                       (the teacher's, the process reward model's)
    after_scoring      the samples carry their scores (the judge's metrics)
    advantages         one recipe may give the advantages instead of the estimator (PRIME)
    after_advantages   the advantages are set; a recipe may add a term (the teacher's)
    before_update      a recipe may hold the actor's update back (critic warmup)
    after_update       the updates ran (PRIME's reward model trains, SPIN's reference moves)

At a checkpoint, every role engine with a `checkpoint` folder is saved and loaded with the
actor (`EngineRole.checkpoint`). A recipe that needs another stage adds it here and to the
step once, for every recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from tensordict import TensorDict

from tephra.controller.samples import Sample
from tephra.controller.step.rounds import Round
from tephra.core.registry import Registry
from tephra.engine_api.loss import LossFn
from tephra.episodes.prompt import Prompt

if TYPE_CHECKING:
    from tephra.controller.config.tree import PPOConfig


@dataclass(frozen=True)
class EngineRole:
    """An engine a recipe asks the workers for, by role name (`teacher`, `prm`,
    `spin_reference`)."""

    name: str
    pool: str
    """The worker group that holds it: `actor` (with the actor), `ref` (with the
    reference, on its pool when `resources.ref.ranks` > 0) or `reward` (the reward pool of
    `resources.reward`)."""
    model_path: str | None = None
    """The model it starts from (resolved like `model.path`); None: the policy's."""
    loss: Callable[[], LossFn] | None = None
    """Builds its training loss (the role trains, `RoleEngines.update`); None: forward only."""
    checkpoint: str | None = None
    """Its folder in a checkpoint (saved and loaded with the actor); None: not saved."""


class RoleEngines(Protocol):
    """What a recipe may ask of the workers' role engines during a step."""

    def log_probs(self, role: str, batch: TensorDict) -> torch.Tensor:
        """The role engine's log-probs of the batch's response tokens [batch, seq]."""
        ...

    def update(self, role: str, batch: TensorDict) -> dict[str, float]:
        """Train the role engine on the batch (mini-batches x epochs as the actor)."""
        ...

    def refresh(self, role: str, folder: Path) -> None:
        """The role engine becomes a copy of the actor (through a checkpoint in `folder`)."""
        ...


@dataclass
class StepState:
    """What one RL step holds between its stages; the hooks read and change it."""

    cfg: PPOConfig
    step: int
    """RL steps completed before this one (0-based index of this step)."""
    rounds: list[Round]
    samples: list[Sample]
    batch: TensorDict
    tokenizer: Any
    run_dir: Path
    engines: RoleEngines
    lap: Callable[[str], None]
    """Ends the current timed stage under the name given (`time/<name>_s`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    scores: torch.Tensor | None = None
    """[batch] the samples' scores (with length shaping) once scored."""
    names: list[str] = field(default_factory=list)
    """[batch] each sample as an error message names it (prompt id, dataset row,
    data_source), set when the samples are scored."""
    forward_passes: int = 0
    trained_passes: int = 0
    train_actor: bool = True
    """Whether the actor's update runs this step (`before_update` may hold it back)."""
    dump: Callable[[Path], None] | None = None
    """Writes the step's training rows (`trainer.dump_generations`); a recipe that trains on
    other rows than the samples (SPIN's pairs) sets its own."""


class Recipe:
    """A method beyond the estimator: override the hooks it needs; every hook does nothing by
    default. One instance per run on the driver, one per worker (where only `roles` and
    `actor_loss` are used)."""

    name: ClassVar[str] = ""
    trains_on_rewards: ClassVar[bool] = True
    """False: the actor's loss reads no rewards, advantages or old log-probs (SPIN's pair
    loss): the step logs the rewards and skips what turns them into advantages."""

    def __init__(self, cfg: PPOConfig) -> None:
        self.cfg = cfg

    @classmethod
    def enabled(cls, cfg: PPOConfig) -> bool:
        """Whether `cfg` turns the recipe on."""
        raise NotImplementedError

    @classmethod
    def check(cls, cfg: PPOConfig) -> None:
        """Refuse options that do not combine with the recipe (while the config loads, before
        Ray starts; called whether or not it is enabled)."""

    @classmethod
    def check_data(cls, cfg: PPOConfig, records: list[Prompt], where: str) -> None:
        """Refuse training prompts the recipe cannot use (`where` names the file), before Ray
        starts; called when it is enabled."""

    @classmethod
    def check_models(cls, cfg: PPOConfig, tokenizer: Any) -> None:
        """Refuse model folders the recipe names that do not fit the policy's (`tokenizer`),
        before Ray starts; called when it is enabled."""

    def roles(self) -> tuple[EngineRole, ...]:
        """The engines the recipe needs beside the actor, reference and critic."""
        return ()

    def actor_loss(self) -> LossFn | None:
        """The actor's loss instead of `actor.objective`'s (None: keep it)."""
        return None

    def after_generation(self, state: StepState) -> None:
        """The step's batch was built from its samples."""

    def forward_passes(self, state: StepState) -> None:
        """Forward passes beside the reference's."""

    def after_scoring(self, state: StepState) -> None:
        """The samples carry their scores."""

    def advantages(self, state: StepState) -> bool:
        """Set `batch["advantages"]` (and `returns`) instead of the estimator: True if done."""
        return False

    def after_advantages(self, state: StepState) -> None:
        """The step's advantages are set."""

    def before_update(self, state: StepState) -> None:
        """Before the critic's and actor's updates."""

    def after_update(self, state: StepState) -> None:
        """After the updates, before the weights go to the rollout engine."""


RECIPES: Registry[type[Recipe]] = Registry("recipe")
"""The recipes by name; `tephra.controller.recipes` registers the built-in ones."""
