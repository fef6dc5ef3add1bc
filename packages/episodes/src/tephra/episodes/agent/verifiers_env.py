"""The `verifiers` episode: an environment written for the `verifiers` package (0.4: a taskset,
its tasks' `@vf.reward` rubric, optionally its own `Env` with several turns or tools) runs its
own episode unchanged, its model calls answered by the policy through the gateway; the
rubric's score of the policy's trace is the trajectory's reward."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tephra.core.errors import ConfigError
from tephra.episodes.agent.black_box import run_black_box
from tephra.episodes.agent.loops import _TokenLoop
from tephra.episodes.extras import require_package
from tephra.episodes.gateway.server import GatewayAccess
from tephra.episodes.prompt import Prompt
from tephra.rollout.base import Rollout, SamplingParams
from tephra.rollout.samples import Sample

VERIFIERS_EXTRA = "tephra-episodes[verifiers]"
"""The extra that installs `verifiers`."""

FIELD = "rollout.agent.verifiers_environment"
KWARGS_FIELD = "rollout.agent.environment_kwargs"

_UNSET_KEY_VAR = "TEPHRA_VERIFIERS_NO_KEY"
"""The environment variable verifiers reads the endpoint's key from: never set, so it sends
`EMPTY`; the gateway reads the trajectory's key from the keyed URL instead (one process-wide
variable cannot hold each concurrent trajectory's key)."""


def taskset_id(spec: str) -> str:
    """The verifiers taskset id of `spec`: a `path/to/taskset.py` file is imported by its
    name with its folder put on `sys.path` (as verifiers imports an installed taskset);
    anything else is the id of an installed taskset package."""
    if spec.endswith(".py"):
        file = Path(spec).expanduser().resolve()
        if not file.is_file():
            raise ConfigError(f"{FIELD}={spec!r}: {file} does not exist; give an existing .py file")
        folder = str(file.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        # verifiers starts a task's tool servers as `python` processes that import the
        # taskset's module by name: they need the folder too
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if folder not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([folder, *paths])
        return file.stem
    return spec


def env_config_data(spec: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The verifiers `EnvConfig` data: `environment_kwargs` (its fields: `taskset`, the
    seats such as `agent`, `id` of a paired `Env`, ...) with the taskset's id set, and each
    seat the kwargs leave unpinned on verifiers' `null` harness (a plain chat loop, with the
    task's MCP tools) in a local `subprocess` runtime (verifiers' defaults are a code-running
    harness in a remote sandbox)."""
    import verifiers.v1 as vf  # the optional extra, checked by the caller
    from verifiers.v1.configs.agent import agent_config_fields

    data: dict[str, Any] = {**kwargs}
    data["taskset"] = {**dict(kwargs.get("taskset") or {}), "id": taskset_id(spec)}
    first = vf.resolve_env_config(dict(data))
    for name, seat in agent_config_fields(first).items():
        pinned = dict(data.get(name) or {})
        if seat.harness is None and "harness" not in pinned:
            pinned["harness"] = {"id": "null"}
        if "runtime" not in seat.model_fields_set and "runtime" not in pinned:
            pinned["runtime"] = {"type": "subprocess"}
        data[name] = pinned
    return data


def load_verifiers_environment(spec: str, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """A function building the `verifiers.v1.Env` of `rollout.agent.verifiers_environment`
    with `environment_kwargs`; the package, the taskset and the config are checked here (the
    taskset imported), so their errors come before Ray starts."""
    require_package("verifiers", "rollout.agent_loop='verifiers'", VERIFIERS_EXTRA)
    if not spec:
        raise ConfigError(
            f"{FIELD} is empty; the `verifiers` episode needs the id of an installed verifiers "
            "taskset or path/to/taskset.py (a module whose __all__ exports a vf.Taskset)"
        )
    import verifiers.v1 as vf  # the optional extra, checked above

    ident = taskset_id(spec)
    if spec == ident and importlib.util.find_spec(ident.replace("-", "_").lower()) is None:
        raise ConfigError(
            f"{FIELD}={spec!r}: no installed module {ident!r}; give path/to/taskset.py or "
            "install the taskset's package"
        )
    try:
        data = env_config_data(spec, kwargs)
        config = vf.resolve_env_config(data)
        vf.environment_class(config.taskset.id, config.id)
    except Exception as exc:  # the taskset's import, its exports, a pydantic error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(
            f"{FIELD}={spec!r} with {KWARGS_FIELD}={kwargs!r}: verifiers refused it: "
            f"{type(exc).__name__}: {first}"
        ) from exc

    def load() -> Any:
        return vf.load_environment(vf.resolve_env_config(env_config_data(spec, kwargs)))

    return load


def verifiers_task(env: Any, item: Prompt) -> Any:
    """The environment's task for `item`: its taskset's `Task` type holding the item's
    messages as `prompt` and `interaction_kwargs` as the task data's other fields (verl's
    per-row `extra_info.interaction_kwargs`: `answer`, ...)."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    data = data_cls.model_validate({**item.interaction_kwargs, "prompt": list(item.messages)})
    return task_cls(data, env.taskset.config.task)


class VerifiersLoop(_TokenLoop):
    """Runs one episode of a `verifiers` environment per trajectory (`Env.run_episode`, its
    agents' model calls sent to the gateway as model `policy`), so its own turns, harness,
    tools and stop conditions decide the conversation; the trajectory is what the gateway
    served; its reward is the rubric's score of the trainable seat's trace (`Trace.reward`,
    the weighted sum of the task's `@vf.reward`s). An episode that fails (verifiers records
    the error) counts as the agent's (`agent_error`, reward 0), unless the token budget cut
    its last turn (`length`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        self._load = load_verifiers_environment(
            cfg.verifiers_environment, dict(cfg.environment_kwargs)
        )
        self._env: Any = None

    def environment(self) -> Any:
        """The environment, built once per loop (its taskset and harnesses are shared)."""
        if self._env is None:
            self._env = self._load()
        return self._env

    async def run(self, rollout: Rollout, sample: Prompt, sampling: SamplingParams) -> Sample:
        import verifiers.v1 as vf  # the optional extra, checked when the loop was built

        env = self.environment()
        task = verifiers_task(env, sample)

        async def agent(gateway: GatewayAccess, item: Prompt) -> float:
            client = vf.EvalClientConfig(
                base_url=gateway.keyed_openai_base_url, api_key_var=_UNSET_KEY_VAR
            )
            ctx = vf.ModelContext(model="policy", client=client)
            # serving(): the interception servers the harness programs call, one set per
            # trajectory (an event loop's own; a step may run on a fresh one)
            async with env.serving():
                episode = await env.run_episode(task, ctx)
            if episode.errors or not episode.ok:
                errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
                cause = f"{errors[-1].type}: {errors[-1].message}" if errors else "not ok"
                raise RuntimeError(f"the verifiers episode failed: {cause}")
            trained = [t for t in episode.traces if t.agent.trainable]
            if len(trained) != 1:
                raise RuntimeError(
                    f"the verifiers episode has {len(trained)} trainable traces; the "
                    "`verifiers` episode trains environments with one trainable seat"
                )
            return float(trained[0].reward)

        return await run_black_box(self, agent, rollout, sample, sampling)
