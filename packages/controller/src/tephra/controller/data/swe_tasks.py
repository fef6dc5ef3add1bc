"""The shipped software-engineering tasks as prompts (`data.source=swe_tasks`): each names
its task for the `swe` environment (`interaction_kwargs["task"]`), which gives the model the
repository's tools and scores the copy it leaves.

The tasks themselves (files, bugs, reference fixes) live in
`tephra.episodes.environments.swe.tasks`: 26 train, 10 held out.
"""

from __future__ import annotations

from tephra.core.errors import ConfigError
from tephra.episodes.environments.swe import get_task, task_names
from tephra.episodes.prompt import Prompt

# The call format is spelled out (hermes, `rollout.agent.tool_call_format`'s default): the
# presets render no tool schemas, so the prompt reads the same under any chat template.
INSTRUCTION = (
    "Fix the bug in this Python repository so that all of its tests pass. Call a tool by "
    'writing <tool_call>{{"name": NAME, "arguments": {{...}}}}</tool_call>. Tools: '
    'list_files {{}}; read_file {{"path"}}; edit_file {{"path", "old", "new"}} '
    '(replaces the exact text old, found once in the file); write_file {{"path", '
    '"content"}}; run_tests {{}}. The test files are read-only. When the tests pass, '
    "answer without a tool call.\n\nIssue: {issue}\nFiles: {files}"
)


def check_swe_setup(agent_loop: str | None, environment: str, where: str = "data.source") -> None:
    """The SWE prompts need the `swe` environment to run them; refused before Ray starts."""
    if agent_loop != "environment" or environment != "swe":
        raise ConfigError(
            f"{where}='swe_tasks' needs rollout.agent_loop=environment and "
            f"rollout.agent.environment=swe (got {agent_loop!r} and {environment!r}): the "
            "environment runs the tools and the tests (see the `swe` preset)"
        )


def swe_task_records(
    split: str, size: int | None = None, names: list[str] | None = None
) -> list[Prompt]:
    """The `train` or `val` tasks (at most `size`) as prompts; `names` (train only) picks
    the training tasks instead of the shipped split."""
    chosen = names if names and split == "train" else task_names(split)
    out = []
    for name in chosen[:size]:
        task = get_task(name, "data.swe_tasks")
        files = ", ".join(sorted(task.files))
        out.append(
            Prompt(
                [
                    {
                        "role": "user",
                        "content": INSTRUCTION.format(issue=task.issue, files=files),
                    }
                ],
                "swe",
                None,
                {"task": name, "split": split},
                interaction_kwargs={"task": name},
                origin=f"SWE task {name!r}",
            )
        )
    if not out:
        raise ConfigError(f"data.source='swe_tasks' has no {split} task to use (size={size})")
    return out
