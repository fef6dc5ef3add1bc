"""The `swe` environment: the model fixes a bug in a small Python repository (a shipped task,
`tephra.episodes.environments.swe.tasks`) with tools that list, read and edit its files and
run its tests, on a copy of its own; the reward is what the tests say of the copy it leaves.

Tools (parsed in `rollout.agent.tool_call_format`, run as the `tool` environment runs
tools): `list_files`, `read_file {path}`, `edit_file {path, old, new}` (replace the one
occurrence of `old`), `write_file {path, content}` and `run_tests` (in the python sandbox).
The task's test files are read-only.

Reward: after every turn that changed the repository (an edit, a write, a test run: a run's
code may write files too) the tests run once more and the turn earns the change of the
repository's score, so the turns' rewards add up to the score of the repository the
trajectory leaves, however it ends. A state's score (`workspace.score`) is 0 when a test that
passed before any edit fails, else the share of the task's tests that pass: leaving the
repository alone scores the share that passed already (`SweTask.noop_score`), the reference
fix 1.0.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

from tephra.episodes.environments.base import Environment, StepResult
from tephra.episodes.environments.swe.tasks import get_task
from tephra.episodes.environments.swe.workspace import (
    EditRefused,
    SweSettings,
    SweWorkspaces,
    score,
)
from tephra.episodes.environments.tool_env import ToolEnvironment
from tephra.episodes.tools.base import Tool, ToolResult

if TYPE_CHECKING:
    from tephra.episodes.agent.base import AgentLoopConfig
    from tephra.episodes.prompt import Prompt

_SHARED: dict[SweSettings, SweWorkspaces] = {}


def shared_workspaces(settings: SweSettings) -> SweWorkspaces:
    """The process's one `SweWorkspaces` of these settings (every trajectory shares it; its
    folders go when the interpreter exits)."""
    if settings not in _SHARED:
        _SHARED[settings] = SweWorkspaces(settings)
    return _SHARED[settings]


class _RepoTool(Tool):
    """A tool on the trajectory's repository (`instance_id`: the trajectory's sample id)."""

    changes = False
    """Whether a successful call may change the repository (its score is then measured)."""

    def __init__(self, workspaces: SweWorkspaces, changed: set[str]) -> None:
        self.workspaces = workspaces
        self.changed = changed

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        try:
            text = await self.call(instance_id, arguments)
        except EditRefused as exc:
            return ToolResult("", error=str(exc))
        if self.changes:
            self.changed.add(instance_id)
        return ToolResult(text)

    @abstractmethod
    async def call(self, instance_id: str, arguments: dict[str, Any]) -> str:
        """The text shown to the model; `EditRefused` for a refused request."""


class ListFiles(_RepoTool):
    name = "list_files"
    description = "List the files of the repository."
    parameters = {"type": "object", "properties": {}, "required": []}

    async def call(self, instance_id: str, arguments: dict[str, Any]) -> str:
        return "\n".join(await self.workspaces.list_files(instance_id)) or "(no files)"


class ReadFile(_RepoTool):
    name = "read_file"
    description = "Show a file of the repository."
    parameters = {
        "type": "object",
        "properties": {"path": {"type": "string", "description": "relative path"}},
        "required": ["path"],
    }

    async def call(self, instance_id: str, arguments: dict[str, Any]) -> str:
        return await self.workspaces.read(instance_id, arguments.get("path"))


class EditFile(_RepoTool):
    name = "edit_file"
    description = "Replace the one occurrence of the text 'old' in a file by 'new'."
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "old": {"type": "string", "description": "exact text, found once in the file"},
            "new": {"type": "string"},
        },
        "required": ["path", "old", "new"],
    }
    changes = True

    async def call(self, instance_id: str, arguments: dict[str, Any]) -> str:
        path = arguments.get("path")
        await self.workspaces.edit(instance_id, path, arguments.get("old"), arguments.get("new"))
        return f"edited {path}"


class WriteFile(_RepoTool):
    name = "write_file"
    description = "Write a whole file of the repository (created or replaced)."
    parameters = {
        "type": "object",
        "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"],
    }
    changes = True

    async def call(self, instance_id: str, arguments: dict[str, Any]) -> str:
        content = arguments.get("content")
        if not isinstance(content, str):
            raise EditRefused("argument 'content' (the file's text) is missing")
        path = arguments.get("path")
        await self.workspaces.write(instance_id, path, content)
        return f"wrote {path}"


class RunTests(_RepoTool):
    name = "run_tests"
    description = "Run the repository's tests and show which fail."
    parameters = {"type": "object", "properties": {}, "required": []}
    changes = True

    async def call(self, instance_id: str, arguments: dict[str, Any]) -> str:
        report = await self.workspaces.run_tests(instance_id)
        total = len(self.workspaces.copy_of(instance_id).task.test_ids)
        lines = [f"{len(report.passed)} of {total} tests pass"]
        lines += [f"FAILED {t}: {why}" for t, why in report.failures.items()]
        if report.output:
            lines.append(report.output)
        return "\n".join(lines)


class SweEnvironment(Environment):
    """One trajectory on a shipped SWE task (module docstring). The item names its task in
    `interaction_kwargs["task"]`; `environment_kwargs` are `SweSettings`."""

    owns_reward = True

    def __init__(
        self,
        tools: dict[str, Tool] | None = None,
        config: AgentLoopConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tools, config, **kwargs)
        self.workspaces = shared_workspaces(SweSettings.from_kwargs(kwargs))
        self.changed: set[str] = set()
        repo_tools: list[Tool] = [
            cls(self.workspaces, self.changed)
            for cls in (ListFiles, ReadFile, EditFile, WriteFile, RunTests)
        ]
        self.inner = ToolEnvironment({t.name: t for t in repo_tools}, config)
        self.instance: str | None = None
        self.score: float | None = None
        self.reported = 0.0

    async def reset(self, item: Prompt) -> list[dict[str, Any]]:
        task = get_task(str(item.interaction_kwargs.get("task")), "interaction_kwargs.task")
        self.task = task
        self.instance = item.sample_id  # set first: close releases even a cancelled create
        await self.workspaces.create(item.sample_id, task)
        return await self.inner.reset(item)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self.inner.tool_schemas()

    async def step(self, action: str) -> StepResult:
        assert self.instance is not None  # reset ran
        copy = self.workspaces.copy_of(self.instance)
        runs_before = len(copy.runs)
        result = await self.inner.step(action)
        reward, first = 0.0, self.score is None
        if first or self.instance in self.changed:
            self.changed.discard(self.instance)
            report = await self.workspaces.run_tests(self.instance)
            self.score = score(self.task, report.passed)
            # the loop sums the turns' rewards in order; from any running sum in [0, 1] a
            # step to 1.0 (or 0.0) lands on it exactly (tested), so a fixed repository sums
            # to 1.0, which pass@k needs (a sample is correct when its score reaches 1)
            reward = self.score - self.reported
            self.reported += reward
        # summed over the turns into the sample's tool_metrics: the trajectory's setup, its
        # scoring runs and the seconds of every test run (the model's and the scoring ones)
        metrics = dict(result.info.get("metrics", {}))
        metrics["swe"] = {
            "setup_s": copy.setup_s if first else 0.0,
            "test_runs": float(len(copy.runs) - runs_before),
            "test_run_s": sum(copy.runs[runs_before:]),
        }
        info = dict(result.info, metrics=metrics, score=self.score)
        return StepResult(result.observation, reward, result.done, result.images, info)

    async def close(self) -> None:
        try:
            await self.inner.close()
        finally:
            if self.instance is not None:
                await self.workspaces.release(self.instance)


__all__ = ["SweEnvironment", "shared_workspaces"]
