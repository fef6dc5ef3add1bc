"""The environment registry: each built-in environment listed by name, and a user's
environment class loaded from a file."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from tephra.core.errors import ConfigError, TephraError
from tephra.core.registry import Registry
from tephra.episodes.environments.base import Environment, EnvironmentFactory
from tephra.episodes.environments.colour_squares import ColourSquaresEnvironment
from tephra.episodes.environments.interaction import AnswerCheckInteraction
from tephra.episodes.environments.openenv_env import OpenEnvEnvironment, check_openenv
from tephra.episodes.environments.remote import REMOTE_FIELD, RemoteEnvironment, RemoteSettings
from tephra.episodes.environments.swe import SweEnvironment, SweSettings
from tephra.episodes.environments.tool_env import ToolEnvironment
from tephra.episodes.user_files import import_file

ENVIRONMENTS: Registry[EnvironmentFactory] = Registry("environment")
"""Environment factories by name: `tool` (the model's tool calls run; the scorer judges the
answer), `answer_check` (a scripted user who knows the answer, verl's interaction),
`colour_squares` (a new coloured square to name after each answer: images each turn), `openenv`
(a session on an OpenEnv server per trajectory, `environment_kwargs.url`), `remote` (a tephra
environment served by `python -m tephra.episodes.environments.serve`, a session per
trajectory), `swe` (fix a bug in a shipped tiny repository with file and test tools; reward:
the share of its tests that pass). Each is
called as `factory(tools, config, **environment_kwargs)` once per trajectory."""
ENVIRONMENTS.register("tool", ToolEnvironment)
ENVIRONMENTS.register("answer_check", AnswerCheckInteraction)
ENVIRONMENTS.register("colour_squares", ColourSquaresEnvironment)
ENVIRONMENTS.register("openenv", OpenEnvEnvironment)
ENVIRONMENTS.register("remote", RemoteEnvironment)
ENVIRONMENTS.register("swe", SweEnvironment)


def is_file_spec(spec: str) -> bool:
    """Whether `spec` names a file (`path/to/env.py:ClassName`) rather than a registry name."""
    return ":" in spec and spec.rsplit(":", 1)[0].endswith(".py")


def get_environment(spec: str) -> EnvironmentFactory:
    """The factory of `spec`: a registered name, or `path/to/file.py:ClassName` (an
    `Environment` subclass in a user's file, imported once). Errors name the field and fix."""
    if not spec:
        raise ConfigError(
            "rollout.agent.environment is empty; the `environment` episode needs one: a name "
            f"in {ENVIRONMENTS.names()} or path/to/file.py:ClassName"
        )
    if not is_file_spec(spec):
        return ENVIRONMENTS.get(spec)
    path, name = spec.rsplit(":", 1)
    file = Path(path).expanduser().resolve()
    where = f"rollout.agent.environment={spec!r}"
    if not file.is_file():
        raise ConfigError(f"{where}: {file} does not exist; give an existing .py file")
    try:
        module = import_file(file, "tephra_environment_")
    except Exception as exc:
        raise ConfigError(f"{where}: importing {file} raised {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        found = sorted(
            n
            for n, v in vars(module).items()
            if inspect.isclass(v) and issubclass(v, Environment) and v is not Environment
        )
        raise ConfigError(
            f"{where}: {file} has no Environment subclass {name!r} (it has {found or 'none'}); "
            "subclass tephra.episodes.environments.Environment"
        )
    return cls


def check_remote(kwargs: dict[str, Any], tools_file: str | None) -> RemoteSettings:
    """The settings valid and, for a server the run starts, the served environment known
    here (a file imported, so its errors come first), before any process starts."""
    settings = RemoteSettings.from_kwargs(kwargs)
    if settings.url is None:
        try:
            get_environment(settings.environment)
        except ConfigError:
            raise
        except TephraError as exc:  # an unknown name: the RegistryError lists the names
            raise ConfigError(
                f"{REMOTE_FIELD}.environment: {exc} (the server the run starts serves those)"
            ) from None
        if settings.environment == "openenv":
            check_openenv(settings.kwargs)
        if settings.environment == "swe":
            SweSettings.from_kwargs(settings.kwargs)
        if settings.environment == "tool" and not tools_file:
            raise ConfigError(
                f"{REMOTE_FIELD}.environment='tool' needs rollout.tools_file (the tools the "
                "started server runs)"
            )
    return settings
