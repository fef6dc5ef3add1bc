"""The `verifiers` episode: an environment written for the `verifiers` package (single-turn,
multi-turn or tool environment) runs its own rollout unchanged, its model calls answered by the
policy through the gateway; its rubric's score is the trajectory's reward."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tephra.core.errors import ConfigError
from tephra.episodes.agent.base import AgentPrompt
from tephra.episodes.agent.black_box import run_black_box
from tephra.episodes.agent.loops import _TokenLoop
from tephra.episodes.extras import require_package
from tephra.episodes.gateway.server import GatewayAccess
from tephra.episodes.user_files import import_file
from tephra.rollout.base import Rollout, SamplingParams
from tephra.rollout.samples import Sample


def load_verifiers_environment(spec: str, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """A function building the environment of `rollout.agent.verifiers_environment`:
    `path/to/env.py:load_environment` (a function returning a `verifiers.Environment`, called
    with `environment_kwargs`) or the id of an installed environment package (what
    `verifiers.load_environment(id, **environment_kwargs)` loads). The file is imported and the
    package found here, so their errors come before Ray starts."""
    where = f"rollout.agent.verifiers_environment={spec!r}"
    require_package("verifiers", "rollout.agent_loop='verifiers'")
    if not spec:
        raise ConfigError(
            "rollout.agent.verifiers_environment is empty; the `verifiers` episode needs "
            "path/to/env.py:load_environment or an installed environment's id"
        )
    path, _, name = spec.rpartition(":")
    if path.endswith(".py"):
        file = Path(path).expanduser().resolve()
        if not file.is_file():
            raise ConfigError(f"{where}: {file} does not exist; give an existing .py file")
        try:
            module = import_file(file, "tephra_verifiers_env_")
        except Exception as exc:
            raise ConfigError(
                f"{where}: importing {file} raised {type(exc).__name__}: {exc}"
            ) from exc
        fn = getattr(module, name, None)
        if not callable(fn):
            raise ConfigError(f"{where}: {file} defines no function {name!r}")
        return lambda: fn(**kwargs)
    module_name = spec.replace("-", "_")
    if importlib.util.find_spec(module_name) is None:
        raise ConfigError(
            f"{where}: no installed module {module_name!r}; give path/to/env.py:function or "
            "install the environment's package"
        )

    def load() -> Any:
        import verifiers  # the optional extra, checked above

        return verifiers.load_environment(spec, **kwargs)

    return load


class VerifiersLoop(_TokenLoop):
    """Runs one rollout of a `verifiers` environment per trajectory (`Environment.run_rollout`
    with an OpenAI Chat Completions client on the gateway, model `policy`), so its own turns,
    parser, tools and stop conditions decide the conversation; the trajectory is what the
    gateway served; its reward is the environment's rubric score (`RolloutOutput.reward`).
    The rollout's input: the item's messages as `prompt`, `interaction_kwargs["answer"]` as
    `answer` (verl's per-row `extra_info.interaction_kwargs`), the other kwargs as `info`. A
    rollout that ends in an error (the environment's `error`) counts as the agent's
    (`agent_error`, reward 0), unless the token budget cut its last turn (`length`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        self._load = load_verifiers_environment(
            cfg.verifiers_environment, dict(cfg.environment_kwargs)
        )
        self._env: Any = None

    def environment(self) -> Any:
        """The environment, built once per loop (its dataset and rubric are shared)."""
        if self._env is None:
            self._env = self._load()
        return self._env

    async def run(self, rollout: Rollout, sample: AgentPrompt, sampling: SamplingParams) -> Sample:
        env = self.environment()

        async def agent(gateway: GatewayAccess, item: AgentPrompt) -> float:
            from openai import AsyncOpenAI  # a dependency of verifiers (the optional extra)
            from verifiers.clients import OpenAIChatCompletionsClient

            client = OpenAIChatCompletionsClient(
                AsyncOpenAI(
                    base_url=gateway.openai_base_url, api_key=gateway.api_key, max_retries=0
                )
            )
            extra = dict(item.interaction_kwargs)
            answer = extra.pop("answer", "")
            rollout_input = {
                "prompt": list(item.messages),
                "example_id": 0,
                "answer": str(answer),
                "info": extra,
            }
            out = await env.run_rollout(rollout_input, client, "policy", {})
            if out.get("error"):
                raise RuntimeError(f"the verifiers environment's rollout failed: {out['error']}")
            return float(out["reward"])

        return await run_black_box(self, agent, rollout, sample, sampling)
