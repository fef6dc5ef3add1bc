"""The imports of every module in the repository's packages and apps (read with `ast`, those
under `TYPE_CHECKING` and inside functions included) form no circle, and every import between
packages follows the workspace's dependency direction (nothing points back up); inside the
controller, every import runs down its ordered layers of sub-packages (`LAYERS`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The dependency direction: the tephra packages each may import (the closure is taken below:
# engine-api brings core, so rollout may import core), as each package's pyproject declares
# them: kernels -> core (its error root and registry) and rollout -> kernels (the hf backend's
# CPU linear layer) among them.
ALLOWED = {
    "core": set(),
    "algos": {"core"},
    "kernels": {"core"},
    "engine_api": {"core"},
    "engine_fsdp": {"engine_api", "kernels"},
    "engine_megatron": {"engine_api", "kernels"},
    "rollout": {"engine_api", "kernels"},
    "episodes": {"core", "rollout"},
    "controller": {"core", "engine_api", "rollout", "episodes", "algos"},
}
APPS = "apps"  # the apps may import any package, and no package imports an app


def closure(allowed: dict[str, set[str]]) -> dict[str, set[str]]:
    out = {k: set(v) for k, v in allowed.items()}
    changed = True
    while changed:
        changed = False
        for deps in out.values():
            more = set().union(*(out.get(d, set()) for d in deps)) - deps
            if more:
                deps |= more
                changed = True
    return out


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package `__init__`) of every source file of the packages
    and apps."""
    found: dict[str, tuple[Path, bool]] = {}
    for src in sorted([*root.glob("packages/*/src"), *root.glob("apps/*/src")]):
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join(parts)] = (path, is_package)
    return found


def imports_of(name: str, mods: dict[str, tuple[Path, bool]]) -> set[str]:
    """The repository's modules that module `name` imports (any import statement in it)."""
    path, is_package = mods[name]
    package = name if is_package else name.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                named.add(sub if sub in mods else base)
    out = set()
    for module in named:
        while module and module not in mods:
            module = module.rpartition(".")[0]
        if module and module != name:
            out.add(module)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    """`tephra.controller.loop.trainer` -> `controller`; an app's modules -> `apps`."""
    parts = module.split(".")
    return APPS if parts[1] == "apps" else parts[1]


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Imports between packages that the dependency direction does not allow."""
    allowed = closure(ALLOWED)
    bad = []
    for module, deps in sorted(graph.items()):
        here = package_of(module)
        for dep in sorted(deps):
            there = package_of(dep)
            if here == there or here == APPS:
                continue
            if there == APPS or there not in allowed[here]:
                bad.append(f"{module} -> {dep} ({here} may import {sorted(allowed[here])})")
    return bad


def graph_of(root: Path) -> dict[str, set[str]]:
    mods = modules(root)
    return {name: imports_of(name, mods) for name in mods}


def test_no_import_circle_in_the_repository():
    graph = graph_of(ROOT)
    assert len(graph) > 200  # every package's and app's modules were read
    found = cycles(graph)
    assert not found, "import circles (modules that import each other, directly or not):\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )


def test_imports_follow_the_dependency_direction():
    bad = wrong_way(graph_of(ROOT))
    assert not bad, "imports against the dependency direction:\n" + "\n".join(bad)


def test_the_allowed_arrows_are_the_packages_declared_dependencies():
    """Each package's pyproject declares exactly the tephra packages `ALLOWED` gives it."""
    for package, deps in ALLOWED.items():
        text = (ROOT / "packages" / package.replace("_", "-") / "pyproject.toml").read_text()
        declared = set(re.findall(r'"tephra-([a-z-]+)', text)) - {package.replace("_", "-")}
        assert {d.replace("-", "_") for d in declared} == deps, package


def test_the_checks_find_a_planted_circle_and_a_wrong_way_import(tmp_path):
    """The reader on a tree of its own: a -> b -> a is a circle; algos -> controller runs up."""
    for package, body in {
        "algos": "from tephra.controller.b import x\n",
        "controller": "",
    }.items():
        src = tmp_path / "packages" / package / "src" / "tephra" / package
        src.mkdir(parents=True)
        (src / "__init__.py").write_text("")
        (src / "a.py").write_text(body)
    ctl = tmp_path / "packages" / "controller" / "src" / "tephra" / "controller"
    (ctl / "a.py").write_text("from tephra.controller import b\n")
    (ctl / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from tephra.controller.a import y\nx = 1\n"
    )
    graph = graph_of(tmp_path)
    assert cycles(graph) == [["tephra.controller.a", "tephra.controller.b"]]
    assert wrong_way(graph) == ["tephra.algos.a -> tephra.controller.b (algos may import ['core'])"]


# The controller's sub-packages from the bottom up: a module may import its own layer and the
# layers before it, never a later one. `samples` is the transport types both sides share.
CONTROLLER = "tephra.controller"
LAYERS = [
    "testing",  # helpers for tests of trainers; imports nothing of the controller
    "data",  # prompt data, the built-in demo datasets and model
    "samples",  # the typed objects between the driver and the workers
    "cluster",  # worker groups, dispatch, watchdog, stop, start-up timeline: no RL
    "run",  # checkpoints, trackers, evaluation, FLOPs, model paths
    "config",  # the config tree
    "step",  # the parts of one step, by stage
    "recipes",  # hooks at the step's named stages
    "workers",  # the rank side: RLWorker, generation, rollout replicas
    "loop",  # the driver side: the Trainer and its parts
    "launch",  # building a run from its config, preflight checks, export
]


def layer_of(module: str) -> int | None:
    """The index in `LAYERS` of a controller module; None for the package's own `__init__` (its
    public names, which may come from any layer)."""
    if module == CONTROLLER:
        return None
    head = module[len(CONTROLLER) + 1 :].split(".")[0]
    return LAYERS.index(head) if head in LAYERS else -1


def controller_problems(graph: dict[str, set[str]]) -> list[str]:
    """The controller's modules outside `LAYERS`, imports from a later layer or of the package's
    own `__init__`, and import circles among its modules."""
    ours = {m for m in graph if m == CONTROLLER or m.startswith(CONTROLLER + ".")}
    bad = [f"{m}: in no layer of LAYERS" for m in sorted(ours) if layer_of(m) == -1]
    for module in sorted(ours):
        here = layer_of(module)
        for dep in sorted(graph[module] & ours):
            there = layer_of(dep)
            if there is None:
                bad.append(f"{module} -> {dep} (the package's __init__ is for users, not modules)")
            elif here is not None and here != -1 and there > here:
                bad.append(f"{module} -> {dep} ({LAYERS[here]} may not import {LAYERS[there]})")
    sub = {m: graph[m] & ours for m in ours}
    bad += ["circle: " + " <-> ".join(c) for c in cycles(sub)]
    return bad


def test_controller_layers_run_one_way():
    graph = graph_of(ROOT)
    assert sum(m.startswith(CONTROLLER + ".") for m in graph) > 50
    bad = controller_problems(graph)
    assert not bad, "controller imports against LAYERS:\n" + "\n".join(bad)


def test_the_layer_check_finds_a_back_import_and_a_circle():
    """A cluster module importing the loop runs back up; two step modules importing each other
    are a circle though they share a layer."""
    graph = {
        f"{CONTROLLER}.cluster.worker_group": {f"{CONTROLLER}.loop.trainer"},
        f"{CONTROLLER}.loop.trainer": {f"{CONTROLLER}.step.a"},
        f"{CONTROLLER}.step.a": {f"{CONTROLLER}.step.b"},
        f"{CONTROLLER}.step.b": {f"{CONTROLLER}.step.a"},
        f"{CONTROLLER}.extra": set(),
    }
    assert controller_problems(graph) == [
        f"{CONTROLLER}.extra: in no layer of LAYERS",
        f"{CONTROLLER}.cluster.worker_group -> {CONTROLLER}.loop.trainer"
        " (cluster may not import loop)",
        f"circle: {CONTROLLER}.step.a <-> {CONTROLLER}.step.b",
    ]


FIRST_IMPORT = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "tephra" or m.startswith("tephra.")]:
        del sys.modules[loaded]  # each one the interpreter's first tephra import
    try:
        importlib.import_module(name)
    except ImportError as exc:
        failed.append(f"{name}: {exc}")
print("\\n".join(failed))
"""


def test_every_package_and_command_module_imports_first():
    """Each package (`__init__`) and each module run with `python -m` imports as the first
    tephra import of an interpreter: a circle through a package's `__init__` (which the
    reader above does not follow) fails only in the order that enters it first, as
    `python -m tephra.episodes.environments.serve` did."""
    import subprocess
    import sys

    mods = modules(ROOT)
    names = [
        name
        for name, (path, is_package) in mods.items()
        if (is_package or '__name__ == "__main__"' in path.read_text())
        and name.startswith("tephra.")
        and "vllm_plugin" not in name  # loaded by vLLM's own interpreter
    ]
    assert "tephra.episodes.environments.serve" in names and len(names) > 40
    done = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT, *names],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", "modules that fail as the first import:\n" + done.stdout
