"""Per-trajectory copies of the SWE tasks' repositories: made once per trajectory, read and
edited by the host without ever leaving the copy, tested in the python sandbox.

Each trajectory's repository is the python sandbox's per-trajectory folder (as root a tmpfs
of `disk_quota_mb` owned by a fresh uid; otherwise a plain folder that each sandbox call
copies in and out). It is filled once, when the trajectory starts, from a template folder of
the task (written once per process): by hard links where the template and the folder share a
filesystem (an ordinary user), else by a copy (as root: a tmpfs is a filesystem of its own);
`benchmarks/swe_workspace.py` measures both. Every edit writes a new file and renames it
over the old name (break-on-write), so no write ever reaches the template through a link.

The host opens paths inside a folder that model-written code has run in, so every host step
goes one name at a time from a descriptor of the trajectory's folder with `O_NOFOLLOW`:
absolute paths and `..` are refused before anything is opened, a link planted by the code is
refused where it stands (never followed), a non-regular file (a FIFO) is refused without
blocking, and the calls of one trajectory (host steps and sandbox runs) run one at a time, so
no host step runs beside its code. Removal is the sandbox's (`folder_tree`: descriptor walks
that never follow a link and stop if the tree moves under them).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import secrets
import stat
import tempfile
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tephra.core.errors import ConfigError
from tephra.episodes.environments.swe.tasks import SweTask
from tephra.episodes.tools.folder_tree import remove_tree
from tephra.episodes.tools.python_sandbox import PythonSandbox, SandboxConfig

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MARK = "@@tephra-swe-results"
MAX_READ_BYTES = 65536
"""Largest file `read` returns whole (a larger one is refused, naming its size)."""
MAX_LISTED = 200
"""Entries `list_files` shows at most."""

# The test runner, sent to the sandbox through stdin: imports each test file from the
# repository (the sandbox's /tmp), runs its module-level test_* functions in source order and
# prints one line with each test's outcome (None: passed). Tests that never report (an import
# that hangs, a crash) count as failed.
_RUNNER = r"""
import importlib.util, json, os, sys, traceback
MARK, FILES = {mark!r}, {files!r}
sys.path.insert(0, os.getcwd())
sys.dont_write_bytecode = True
results = {{}}
for path in FILES:
    name = path[:-3].replace("/", ".")
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException as exc:
        print(f"{{path}}: import failed: {{type(exc).__name__}}: {{exc}}")
        continue
    tests = [v for k, v in vars(module).items() if k.startswith("test_") and callable(v)]
    for test in tests:
        key = f"{{path}}::{{test.__name__}}"
        try:
            test()
            results[key] = None
        except BaseException as exc:
            line = traceback.format_exception_only(type(exc), exc)[-1].strip()
            results[key] = line[:300]
sys.stdout.flush()
print("\n" + MARK + " " + json.dumps(results), flush=True)
"""


class EditRefused(Exception):
    """A host step the model asked for that is refused (the message goes back to it)."""


@dataclass(frozen=True)
class SweSettings:
    """`rollout.agent.environment_kwargs` of the `swe` environment (all optional)."""

    test_timeout_s: float = 10.0
    """Wall-clock seconds of one test run in the sandbox (interpreter start included)."""
    memory_mb: int = 256
    """Address space per process of a test run, MiB."""
    workdir_root: str | None = None
    """Where the per-trajectory repositories and the task templates live (default: the
    system temp folder). As root each repository is a tmpfs of its own wherever this is."""
    workspace: str = "auto"
    """How a trajectory's repository is made from the task's template: `auto` (hard links
    where the filesystem allows, else a copy) or `copy` (always a copy)."""

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> SweSettings:
        """Checked settings; errors name the field and the fix (called when the config
        loads, before Ray starts)."""
        where = "rollout.agent.environment_kwargs"
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(
                f"{where} has {unknown}, which the `swe` environment does not take; it takes "
                f"{sorted(names)}"
            )
        settings = cls(**kwargs)
        if not settings.test_timeout_s > 0:
            raise ConfigError(f"{where}.test_timeout_s={settings.test_timeout_s!r} must be > 0")
        if settings.memory_mb < 64:
            raise ConfigError(
                f"{where}.memory_mb={settings.memory_mb!r}: Python needs at least 64 MiB"
            )
        if settings.workspace not in ("auto", "copy"):
            raise ConfigError(
                f"{where}.workspace={settings.workspace!r}: choose 'auto' (hard links where "
                "possible) or 'copy'"
            )
        if settings.workdir_root is not None and not os.path.isdir(settings.workdir_root):
            raise ConfigError(
                f"{where}.workdir_root={settings.workdir_root!r} is not a folder; give an "
                "existing one (or leave it out for the system temp folder)"
            )
        return settings


@dataclass
class TestReport:
    """One run of a repository's tests."""

    passed: frozenset[str]
    """Ids of the task's tests that passed."""
    failures: dict[str, str]
    """Failed test id -> the reason (its exception's last line, or why it never ran)."""
    output: str
    """What the run printed besides the runner's result line (capped by the sandbox)."""
    error: str | None
    """The sandbox's reason when the run itself failed (wall time, output, memory)."""
    seconds: float


@dataclass
class _Copy:
    task: SweTask
    workdir: str
    uid: int | None
    mounted: bool
    linked: int = 0
    setup_s: float = 0.0
    runs: list[float] = field(default_factory=list)


def check_path(path: Any) -> list[str]:
    """The names of a relative path inside the repository; refuses (naming why) an absolute
    path, `..`, empty names and NUL bytes before anything is opened."""
    if not isinstance(path, str) or not path.strip():
        raise EditRefused("argument 'path' (a file path relative to the repository) is missing")
    if "\0" in path:
        raise EditRefused(f"path {path!r} holds a NUL byte")
    if path.startswith("/"):
        raise EditRefused(f"path {path!r} is absolute; give a path relative to the repository")
    names = [n for n in path.split("/") if n not in ("", ".")]
    if ".." in names:
        raise EditRefused(f"path {path!r} leaves the repository ('..' is not allowed)")
    if not names:
        raise EditRefused(f"path {path!r} names the repository itself, not a file")
    return names


def _open_parent(root: str, names: list[str], create: bool = False) -> int:
    """A descriptor of the folder holding `names[-1]`, reached one name at a time from
    `root` without following any link (ELOOP/ENOTDIR on a link become refusals)."""
    fd = os.open(root, _DIR)
    try:
        for name in names[:-1]:
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise EditRefused(f"no folder {name!r} in the repository") from None
                os.mkdir(name, 0o755, dir_fd=fd)
                child = os.open(name, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise EditRefused(f"{name!r} is a link or not a folder; refused") from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(root: str, path: Any, limit: int = MAX_READ_BYTES) -> str:
    """The text of `path` inside `root` (a regular file, reached without links)."""
    names = check_path(path)
    parent = _open_parent(root, names)
    try:
        try:
            fd = os.open(
                names[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
            )
        except FileNotFoundError:
            raise EditRefused(f"no file {path!r} in the repository") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise EditRefused(f"{path!r} is a link; links are not followed") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise EditRefused(f"{path!r} is not a regular file")
            if st.st_size > limit:
                raise EditRefused(f"{path!r} has {st.st_size} bytes, over the {limit} shown")
            data = os.pread(fd, limit + 1, 0)
        finally:
            os.close(fd)
    finally:
        os.close(parent)
    return data.decode(errors="replace")


def write_file(root: str, path: Any, text: str, owner: int | None) -> None:
    """Replace (or create) `path` inside `root` with `text`: a new file renamed over the
    name, so a link at that name is replaced, never written through."""
    names = check_path(path)
    parent = _open_parent(root, names, create=True)
    try:
        tmp = f".tephra-edit-{secrets.token_hex(6)}"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=parent,
        )
        try:
            os.write(fd, text.encode())
            if owner is not None:
                os.fchown(fd, owner, owner)
        finally:
            os.close(fd)
        try:
            os.rename(tmp, names[-1], src_dir_fd=parent, dst_dir_fd=parent)
        except OSError as exc:
            os.unlink(tmp, dir_fd=parent)
            if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise EditRefused(f"{path!r} is a folder") from None
            raise
    finally:
        os.close(parent)


def list_files(root: str, limit: int = MAX_LISTED) -> list[str]:
    """The repository's files, sorted (links shown as `name -> (link)`, never followed;
    at most `limit` entries)."""
    found: list[str] = []
    pending = [("", os.open(root, _DIR))]
    try:
        while pending and len(found) <= limit:
            prefix, fd = pending.pop()
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        st = entry.stat(follow_symlinks=False)
                        rel = prefix + entry.name
                        if stat.S_ISDIR(st.st_mode):
                            try:
                                pending.append((rel + "/", os.open(entry.name, _DIR, dir_fd=fd)))
                            except OSError:
                                found.append(rel + "/ (unreadable)")
                        elif stat.S_ISLNK(st.st_mode):
                            found.append(f"{rel} -> (link)")
                        elif not entry.name.startswith(".tephra-edit-"):
                            found.append(rel)
            finally:
                os.close(fd)
    finally:
        for _, fd in pending:
            os.close(fd)
    found.sort()
    return found[:limit] + ([f"... (more than {limit} entries)"] if len(found) > limit else [])


def _fill(template: str, workdir: str, files: list[str], owner: int | None, link: bool) -> int:
    """Put the task's `files` into the fresh `workdir`: hard links to the template where
    allowed (returns how many), else copies."""
    linked = 0
    for path in files:
        names = path.split("/")
        parent = _open_parent(workdir, names, create=True)
        try:
            if link:
                try:
                    os.link(
                        os.path.join(template, path),
                        names[-1],
                        dst_dir_fd=parent,
                        follow_symlinks=False,
                    )
                    linked += 1
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                        raise
        finally:
            os.close(parent)
        with open(os.path.join(template, path), encoding="utf-8") as f:
            write_file(workdir, path, f.read(), owner)
    return linked


class SweWorkspaces:
    """The repositories of every trajectory in flight (one object per process serves them
    all, keyed by trajectory id), and their test runs in the python sandbox."""

    def __init__(self, settings: SweSettings | None = None) -> None:
        self.settings = settings or SweSettings()
        s = self.settings
        self.sandbox = PythonSandbox(
            SandboxConfig(
                timeout_s=s.test_timeout_s,
                cpu_time_s=max(1, int(s.test_timeout_s)),
                memory_mb=s.memory_mb,
                max_output_bytes=32768,
                disk_quota_mb=16,
                max_files=512,
                workdir_root=s.workdir_root,
            )
        )
        self.template_root = tempfile.mkdtemp(prefix="tephra-swe-tasks-", dir=s.workdir_root)
        self._templates: dict[str, str] = {}
        self._copies: dict[str, _Copy] = {}
        self._making: dict[str, asyncio.Future] = {}
        self._locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # folders of trajectories never released, and the templates, go when this object is
        # collected or the interpreter exits
        self._finalizer = weakref.finalize(self, _remove_all, self._copies, self.template_root)

    @contextlib.asynccontextmanager
    async def _alone(self, instance_id: str) -> AsyncIterator[None]:
        """Hold the trajectory: its folder is the code's (a test run) or the host's, never
        both at once."""
        locks = self._locks.setdefault(asyncio.get_running_loop(), {})
        async with locks.setdefault(instance_id, asyncio.Lock()):
            yield

    def template(self, task: SweTask) -> str:
        """The task's files, written once per process, read-only."""
        if task.name not in self._templates:
            folder = os.path.join(self.template_root, task.name)
            for path, text in task.files.items():
                target = os.path.join(folder, path)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "w", encoding="utf-8") as f:
                    f.write(text)
                os.chmod(target, 0o444)
            self._templates[task.name] = folder
        return self._templates[task.name]

    def _make(self, task: SweTask) -> _Copy:
        start = time.perf_counter()
        uid = self.sandbox.new_uid()
        workdir, mounted = self.sandbox.make_workdir(uid)
        link = self.settings.workspace == "auto" and self.sandbox.namespaced
        try:
            linked = _fill(self.template(task), workdir, list(task.files), uid, link)
        except BaseException:
            PythonSandbox.remove_workdir(workdir, mounted)
            raise
        return _Copy(task, workdir, uid, mounted, linked, time.perf_counter() - start)

    async def create(self, instance_id: str, task: SweTask) -> None:
        """The trajectory's own repository of `task` (again for a known id: nothing). A
        create cancelled (a deadline) while the folder is being made still records it when
        done, and `release` waits for that, so a cancelled start leaks no folder or mount."""
        async with self._alone(instance_id):
            if instance_id in self._copies:
                return
            making = asyncio.ensure_future(asyncio.to_thread(self._make, task))
            self._making[instance_id] = making

            def record(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._copies.setdefault(instance_id, done.result())

            making.add_done_callback(record)
            await asyncio.shield(making)

    def copy_of(self, instance_id: str) -> _Copy:
        if instance_id not in self._copies:
            raise KeyError(f"trajectory {instance_id!r} has no repository (create it first)")
        return self._copies[instance_id]

    async def list_files(self, instance_id: str) -> list[str]:
        async with self._alone(instance_id):
            return await asyncio.to_thread(list_files, self.copy_of(instance_id).workdir)

    async def read(self, instance_id: str, path: Any) -> str:
        async with self._alone(instance_id):
            return await asyncio.to_thread(read_file, self.copy_of(instance_id).workdir, path)

    async def write(self, instance_id: str, path: Any, text: str) -> None:
        """Replace `path` with `text`; the task's test files are refused."""
        copy = self._writable(instance_id, path)
        async with self._alone(instance_id):
            await asyncio.to_thread(write_file, copy.workdir, path, text, copy.uid)

    def _writable(self, instance_id: str, path: Any) -> _Copy:
        copy = self.copy_of(instance_id)
        if "/".join(check_path(path)) in copy.task.test_files:
            raise EditRefused(f"{path!r} is one of the task's tests, which are read-only")
        return copy

    async def edit(self, instance_id: str, path: Any, old: Any, new: Any) -> None:
        """Replace the one occurrence of `old` in `path` by `new` (the model's arguments,
        checked here)."""
        self._writable(instance_id, path)
        if not isinstance(old, str) or not old:
            raise EditRefused("argument 'old' (the exact text to replace) is missing")
        if not isinstance(new, str):
            raise EditRefused("argument 'new' (the replacement text) is missing")
        text = await self.read(instance_id, path)
        count = text.count(old)
        if count != 1:
            raise EditRefused(
                f"'old' occurs {count} times in {path!r}; give text that occurs exactly once"
            )
        await self.write(instance_id, path, text.replace(old, new))

    async def run_tests(self, instance_id: str) -> TestReport:
        """Run the task's tests on the trajectory's repository in the sandbox, the test
        files first restored from the task (code of an earlier run may have changed them)."""
        copy = self.copy_of(instance_id)
        task = copy.task
        async with self._alone(instance_id):
            for path in task.test_files:
                await asyncio.to_thread(write_file, copy.workdir, path, task.files[path], copy.uid)
            mark = f"{_MARK}-{secrets.token_hex(8)}"
            program = _RUNNER.format(mark=mark, files=task.test_files)
            run = await self.sandbox.run(program, copy.workdir, copy.uid)
            if not self.sandbox.namespaced:
                quota = await asyncio.to_thread(self.sandbox.check_quota, copy.workdir)
                run.error = quota or run.error
        copy.runs.append(run.wall_s)
        results: dict[str, Any] = {}
        lines = run.stdout.splitlines()
        shown = []
        for line in lines:
            if line.startswith(mark + " "):
                with contextlib.suppress(ValueError):
                    results = json.loads(line[len(mark) + 1 :])
            elif line.strip():
                shown.append(line)
        reason = run.error or "the test run ended before reporting"
        failures = {
            t: (results[t] if t in results else f"did not run ({reason})")
            for t in task.test_ids
            if t not in results or results[t] is not None
        }
        passed = frozenset(t for t in task.test_ids if t not in failures)
        output = "\n".join(shown) + (("\n" + run.stderr) if run.stderr.strip() else "")
        return TestReport(passed, failures, output.strip(), run.error, run.wall_s)

    async def release(self, instance_id: str) -> None:
        making = self._making.pop(instance_id, None)
        if making is not None and not making.done():  # a (cancelled) create still at work
            with contextlib.suppress(Exception):  # its own error was its caller's
                await asyncio.shield(making)
        async with self._alone(instance_id):
            copy = self._copies.pop(instance_id, None)
            if copy is not None:
                await asyncio.to_thread(PythonSandbox.remove_workdir, copy.workdir, copy.mounted)
        for locks in self._locks.values():
            locks.pop(instance_id, None)

    def close(self) -> None:
        """Remove every repository still held and the templates."""
        self._finalizer()


def _remove_all(copies: dict[str, _Copy], template_root: str) -> None:
    for copy in copies.values():
        PythonSandbox.remove_workdir(copy.workdir, copy.mounted)
    copies.clear()
    remove_tree(template_root)


def score(task: SweTask, passed: frozenset[str]) -> float:
    """The reward of a repository state: 0 when a test that passed before any edit fails
    now (a regression), else the share of the task's tests that pass."""
    before = set(task.test_ids) - set(task.failing)
    if before - passed:
        return 0.0
    return len(passed) / len(task.test_ids)


__all__ = [
    "EditRefused",
    "SweSettings",
    "SweWorkspaces",
    "TestReport",
    "check_path",
    "list_files",
    "read_file",
    "score",
    "write_file",
]
