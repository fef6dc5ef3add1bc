"""The registry, the error tree, the loader and the per-machine choices, each against
hand-written expectations."""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tephra.core import (
    BatchError,
    ConfigError,
    InputError,
    Registry,
    RegistryError,
    TephraError,
    cache_root,
    cpu_flags,
    cpu_name,
    decided_once_per_machine,
    load_config,
    machine,
    split_cli,
)
from tephra.core.config import from_dict, to_dict
from tephra.core.host_memory import retain_supported
from tephra.core.machine import CHOICES_FILE


def test_registry_metadata_aliases_and_errors():
    reg = Registry("estimator")

    @reg.register("gae", needs_values=True)
    def gae():
        return 1

    reg.register("grpo", lambda: 2, needs_groups=True)
    reg.register("grpo_vectorized", reg.get("grpo"), needs_groups=True)  # alias
    assert reg.get("gae") is gae and reg.meta("gae") == {"needs_values": True}
    assert reg.names(needs_groups=True) == ["grpo", "grpo_vectorized"]
    assert reg.names() == ["gae", "grpo", "grpo_vectorized"] and len(reg) == 3
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("gae", lambda: 3)
    with pytest.raises(RegistryError) as info:
        reg.check("grp", field="algorithm.adv_estimator")
    assert str(info.value).startswith("algorithm.adv_estimator='grp': unknown estimator 'grp'")
    assert "did you mean 'grpo'" in str(info.value)
    assert isinstance(info.value, TephraError) and isinstance(info.value, KeyError)
    assert issubclass(BatchError, InputError) and issubclass(ConfigError, ValueError)


@dataclass
class Inner:
    lr: float = 1e-3
    """lr."""
    betas: tuple[float, float] = (0.9, 0.99)
    """betas."""
    targets: list[str] | str = "all-linear"
    """modules."""
    steps: int = 1
    """steps."""

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"inner.lr={self.lr} must be > 0")


@dataclass
class Outer:
    name: str = "x"
    """name."""
    flag: bool = False
    """flag."""
    inner: Inner = field(default_factory=Inner)
    """inner section."""
    maybe: int | None = None
    """optional."""


def test_loader_coerces_merges_and_refuses(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("inner:\n  lr: 0.5\n  steps: 4\nname: from-preset\n")
    cfg = load_config(
        Outer,
        [str(preset)],
        [
            "inner.steps=7",
            "flag=yes",
            "inner.betas=[0.8, 0.9]",
            "inner.targets=[q_proj,v_proj]",
            "maybe=3",
        ],
    )
    assert cfg == Outer(
        name="from-preset",
        flag=True,
        maybe=3,
        inner=Inner(lr=0.5, betas=(0.8, 0.9), targets=["q_proj", "v_proj"], steps=7),
    )
    assert load_config(Outer).inner.targets == "all-linear"  # a str stays a str in list | str
    # a str field takes the override as written: YAML would make `off` False, `1e-3` a float
    assert load_config(Outer, overrides=["name=off"]).name == "off"
    assert load_config(Outer, overrides=["name=1e-3"]).name == "1e-3"
    bad = [
        (["inner.lrr=1"], "unknown config key 'inner.lrr'; did you mean 'inner.lr'"),
        (["inner.steps=2.5"], "inner.steps=2.5 must be an integer"),
        (["flag=maybe"], "flag='maybe' must be true or false"),
        (["inner.lr=-1"], "inner.lr=-1.0 must be > 0"),
        (["inner.betas=[1]"], "must hold 2 values"),
        (["nokey"], "is not an override; write key=value"),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
            load_config(Outer, overrides=overrides)
    with pytest.raises(ConfigError, match="known presets"):
        load_config(Outer, ["nope"], preset_dir=tmp_path)
    assert split_cli(["-p", "a", "preset=b,c", "x=1"]) == (["a", "b", "c"], ["x=1"])


@dataclass
class Bounds:
    clip: float = 0.2
    """clip."""
    low: float | None = None
    """derived from clip when None."""
    steps: int = 1
    """steps."""

    def __post_init__(self):
        if self.low is None:
            self.low = self.clip


@dataclass
class App:
    bounds: Bounds = field(default_factory=lambda: Bounds(steps=5))
    """a section whose default differs from its class's."""
    plain: Bounds = field(default_factory=Bounds)
    """a section with its class's defaults."""


def test_partial_override_keeps_the_parents_default_and_rederives():
    cfg = load_config(App, overrides=["bounds.clip=0.3", "plain.clip=0.4"])
    # steps=5 comes from App's default for the section; low follows the new clip
    assert cfg.bounds == Bounds(clip=0.3, low=0.3, steps=5)
    assert cfg.plain == Bounds(clip=0.4, low=0.4, steps=1)
    assert load_config(App).bounds == Bounds(steps=5)


@dataclass
class Library:
    REQUIRED_HINTS: ClassVar[dict[str, str]] = {"model": "set model.path=..., e.g. model.path=x"}
    model: Bounds
    """required: no default."""
    bounds: Bounds = field(default_factory=Bounds)
    """a neutral section."""
    options: dict[str, Any] = field(default_factory=dict)
    """a mapping field."""
    tags: list[str] = field(default_factory=list)
    """a list field."""


@dataclass
class LibraryWithTheAppsDefaults:
    """The reference: the same defaults written as the library's own."""

    model: Bounds = field(default_factory=lambda: Bounds(steps=7))
    """as base.model."""
    bounds: Bounds = field(default_factory=lambda: Bounds(clip=0.1, steps=3))
    """as base.bounds."""
    options: dict[str, Any] = field(default_factory=lambda: {"a": 1, "b": 2})
    """as base.options."""
    tags: list[str] = field(default_factory=lambda: ["x"])
    """as base.tags."""


def test_a_base_instance_stands_in_for_the_defaults(tmp_path):
    """An app's defaults (`base`) over a library's compose exactly as the same defaults
    written into the library's classes: a preset's section keeps what the base set in it, a
    mapping or list from a preset replaces the base's whole; a required field is one error
    naming the key and the fix."""
    base = Library(
        model=Bounds(steps=7),
        bounds=Bounds(clip=0.1, steps=3),
        options={"a": 1, "b": 2},
        tags=["x"],
    )
    (tmp_path / "p.yaml").write_text("bounds: {clip: 0.5}\noptions: {c: 3}\n")
    for presets, overrides in (([], []), ([tmp_path / "p.yaml"], ["tags=[y]", "model.clip=0.3"])):
        got = to_dict(load_config(Library, presets, overrides, base=base))
        assert got == to_dict(load_config(LibraryWithTheAppsDefaults, presets, overrides))
    assert got["options"] == {"c": 3} and got["tags"] == ["y"]
    assert got["bounds"] == {"clip": 0.5, "low": 0.1, "steps": 3}  # low: set by the base
    assert load_config(Library, base=base) == base
    with pytest.raises(
        ConfigError, match=r"^config key 'model' is required and not set: set model.path=\.\.\., e"
    ):
        load_config(Library, overrides=["bounds.clip=0.3"])


@dataclass
class Wrapper:
    inner: Bounds
    """required, with no hint."""


def test_a_required_field_without_a_hint_names_its_dotted_key():
    with pytest.raises(
        ConfigError,
        match=r"^config key 'inner' is required and not set: set it in a preset or as `inner=\.\.\.`",
    ):
        from_dict(Wrapper, {})


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TEPHRA_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("TEPHRA_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "tephra"


ZEN1 = "processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 23\nmodel\t\t: 1\nflags\t\t: fpu avx2 fma\n"
"""/proc/cpuinfo's first lines on a virtual machine that names its CPU generically"""


def test_cpu_name_tells_apart_cpus_that_share_a_model_name(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "CPUINFO", tmp_path / "cpuinfo")
    names = {}
    for label, text in {
        "zen1": ZEN1,
        "zen1, second processor listed": ZEN1 + ZEN1.replace(": 0", ": 1").replace("23", "99"),
        "zen1, flags in another order": ZEN1.replace("fpu avx2 fma", "fma fpu avx2"),
        "zen5": ZEN1.replace("23", "26").replace(": 1\n", ": 2\n"),
        "zen1 with avx512_bf16": ZEN1.replace("fma", "fma avx512_bf16"),
    }.items():
        machine.CPUINFO.write_text(text)
        names[label] = cpu_name()
    digest = hashlib.sha256(b"avx2 fma fpu").hexdigest()[:8]
    assert names["zen1"] == f"AMD EPYC (cpu family 23, model 1, flags {digest})"
    assert (
        names["zen1"]
        == names["zen1, second processor listed"]
        == names["zen1, flags in another order"]
    )
    assert len({names["zen1"], names["zen5"], names["zen1 with avx512_bf16"]}) == 3
    machine.CPUINFO.unlink()  # not Linux: what platform knows
    assert cpu_name() and "(" not in cpu_name()


def test_masked_flags_are_absent_everywhere_tephra_reads_them(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "CPUINFO", tmp_path / "cpuinfo")
    machine.CPUINFO.write_text(ZEN1.replace("fma", "fma avx512f avx512_bf16"))
    full = cpu_name()
    assert cpu_flags() == {"fpu", "avx2", "fma", "avx512f", "avx512_bf16"}
    monkeypatch.setenv(machine.MASK_FLAGS_ENV, "avx512_bf16, avx512f amx_bf16")
    assert cpu_flags() == {"fpu", "avx2", "fma"}
    assert machine.cpu_fields()["flags"] == "fpu avx2 fma"
    # the same name as a CPU that has only those flags: choices timed under the mask are
    # recorded apart from the full CPU's
    masked = cpu_name()
    machine.CPUINFO.write_text(ZEN1)
    monkeypatch.delenv(machine.MASK_FLAGS_ENV)
    assert masked == cpu_name() != full
    machine.CPUINFO.unlink()
    assert cpu_flags() == frozenset()


def _counting(log, answer):
    def measure():
        with open(log, "a") as f:
            f.write("measured\n")
        time.sleep(0.2)  # long enough for the other processes to be waiting on the lock
        return answer

    return measure


def _decide_in_child(log, answer, queue):
    queue.put(decided_once_per_machine("q", _counting(log, answer)))


def test_a_choice_is_measured_once_per_machine_and_read_by_later_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("TEPHRA_CACHE", str(tmp_path / "cache"))
    log, path = tmp_path / "measured.log", tmp_path / "cache" / CHOICES_FILE
    # four processes starting together, each of which would answer differently from its
    # neighbour: one measures, the others read its answer
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_decide_in_child, args=(log, i % 2 == 0, queue)) for i in range(4)]
    for p in procs:
        p.start()
    answers = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert len(set(answers)) == 1 and log.read_text().count("measured") == 1
    assert json.loads(path.read_text()) == {"q": answers[0]}
    # a later process reads the record (here hand-set) and does not measure
    path.write_text(json.dumps({"q": "recorded", "other": 1}))
    assert decided_once_per_machine("q", _counting(log, "new")) == "recorded"
    assert log.read_text().count("measured") == 1
    # an answer `accept` refuses, and a torn file, are measured again and rewritten
    assert (
        decided_once_per_machine("q", _counting(log, "new"), accept=lambda v: v != "recorded")
        == "new"
    )
    assert json.loads(path.read_text()) == {"q": "new", "other": 1}
    path.write_text("{not json")
    assert decided_once_per_machine("q", _counting(log, 3)) == 3
    assert json.loads(path.read_text()) == {"q": 3}
    assert log.read_text().count("measured") == 3


def test_without_a_writable_cache_each_process_measures(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("TEPHRA_CACHE", str(tmp_path / "a_file"))  # no folder can be made here
    log = tmp_path / "measured.log"
    for _ in range(2):
        assert decided_once_per_machine("q", _counting(log, False)) is False
    assert log.read_text().count("measured") == 2


REFAULT = """
import resource, sys
from tephra.core.host_memory import retain_freed_memory
kept = sys.argv[1] == "1" and retain_freed_memory()
for _ in range(2):
    b"x" * (48 << 20)  # a 48 MiB block, written through, then freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
b"x" * (48 << 20)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not retain_supported(), reason="needs glibc")
def test_retained_memory_is_reused_without_page_faults():
    """glibc maps a fresh 48 MiB block for each allocation by default (over its 32 MiB cap
    on the mmap threshold), so it faults in every page again; with the thresholds raised the
    freed block is reused. Fresh interpreters, so no earlier allocation shapes the heap."""

    def faults(retain: bool) -> tuple[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", REFAULT, str(int(retain))],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return out[0], int(out[1])

    pages = (48 << 20) // resource.getpagesize()
    kept, default = faults(False)
    assert kept == "False" and default >= pages * 0.9
    kept, retained = faults(True)
    assert kept == "True" and retained < pages * 0.01


def test_third_party_syntax_warnings_are_dropped_and_the_users_kept(tmp_path):
    for folder in ("site-packages/noisy", "mine"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text('x = 1\nflag = x is "recursive"\n')
    program = (
        "import sys\n"
        f"sys.path[:0] = [{str(tmp_path / 'site-packages')!r}, {str(tmp_path)!r}]\n"
        "from tephra.core.quiet import quiet_third_party_warnings\n"
        "quiet_third_party_warnings()\n"
        "import noisy, mine\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program],
        env={"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "noisy" not in result.stderr
    assert result.stderr.count("SyntaxWarning") == 1 and "mine/__init__.py" in result.stderr


class _Wrapped(Exception):
    """How Ray hands a worker's error to the driver: the error itself in `.cause`."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"RayTaskError: long traceback ... {cause}")
        self.cause = cause


@pytest.mark.parametrize(
    ("outcome", "code", "stdout", "stderr"),
    [
        ({"status": "completed", "steps": 3}, None, '{"steps": 3}\n', ""),
        ({"status": "stopped", "exit_code": 143}, 143, '{"exit_code": 143}\n', ""),
        (ConfigError("data.source=None: set data.source"), 2, "", "error: data.source=None"),
        (_Wrapped(ConfigError("rank 1: x=2")), 2, "", "error: rank 1: x=2\n"),
        (KeyboardInterrupt(), 130, "", "interrupted (Ctrl-C)\n"),
    ],
)
def test_app_main_prints_the_summary_or_one_error_line_and_exits_with_its_code(
    outcome: Any, code: int | None, stdout: str, stderr: str, capsys: pytest.CaptureFixture
) -> None:
    from tephra.core.app_help import AppHelp, app_main  # noqa: PLC0415

    def run(cfg: dict[str, Any]) -> dict[str, Any]:
        assert cfg == {"argv": ["a=1"]}
        if isinstance(outcome, BaseException):
            raise outcome
        return dict(outcome)

    app = AppHelp("app", "", Path("."), Path("index.json"), "app")
    show = lambda s: {k: v for k, v in s.items() if k != "status"}  # noqa: E731
    with contextlib.ExitStack() as stack:
        if code is not None:
            exited = stack.enter_context(pytest.raises(SystemExit))
        app_main(["a=1"], app, lambda argv: {"argv": argv}, dict, run, show)
    if code is not None:
        assert exited.value.code == code
    out, err = capsys.readouterr()
    assert out == stdout
    assert err.startswith(stderr) and "Traceback" not in err


def test_app_main_prints_the_config_and_lets_other_errors_through(
    capsys: pytest.CaptureFixture,
) -> None:
    from tephra.core.app_help import AppHelp, app_main  # noqa: PLC0415

    app = AppHelp("app", "", Path("."), Path("index.json"), "app")

    def never(cfg: Any) -> dict[str, Any]:
        raise AssertionError("--print-config must not run")

    app_main(["b=2", "--print-config"], app, lambda a: a, lambda a: {"b": a}, never)
    assert capsys.readouterr().out == "b:\n- b=2\n"
    with pytest.raises(_Wrapped):  # not a TephraError inside: a bug, with its traceback
        app_main([], app, lambda a: a, dict, lambda c: (_ for _ in ()).throw(_Wrapped(OSError())))
