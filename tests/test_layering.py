"""Imports flow one way (../shared/STYLE.md): commands and the web layer on top, then the
orchestration (doctor, launch, the scheduler, remote backends), then training, planning and
policy, then checkpoints, the ledger and metrics, then the recipe, then the base. A module may
import its own layer or the ones below, never above; training and planning never import each
other; there is no import cycle, between modules or between packages. Imports inside functions
count too: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ember"

LAYERS = [
    {"errors", "faults", "proc", "jsonl", "durable", "paths", "events", "lock", "scratch", "device", "hardware",
     "control", "cgroup", "world"},  # base
    {"config", "recipe", "models", "parallel"},  # parallel: the strategies' descriptions, which the recipe names
    {"ckpt", "ledger", "metrics", "runfolder", "launchspec"},
    {"data", "train", "plan", "policy", "infer"},
    {"doctor", "launch", "ranks", "supervise", "sched", "remote"},
    {"cli", "web"},
    {"__main__"},  # `python -m ember`: the entry point, above everything
]
NEVER = {("train", "plan"), ("plan", "train"),  # training and planning do not import each other
         ("data", "train"), ("data", "plan")}  # the data pipeline sits below training


def component(module: str) -> str:
    """ember.train.loop -> train; ember.errors -> errors; ember -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(module: str) -> int:
    name = component(module)
    for i, names in enumerate(LAYERS):
        if name in names:
            return i
    raise AssertionError(f"{module}: its package '{name}' has no layer in tests/test_layering.py: "
                         f"add it to LAYERS where it belongs")


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The ember modules `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ember")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ember"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m in known and m != "ember"}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) for name, path in known.items() if name != "ember"}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None
    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_module_imports_a_layer_above_it():
    wrong = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
             for a, deps in graph().items() for b in deps if layer(b) > layer(a)]
    assert not wrong, "\n".join(wrong)


def test_training_and_planning_do_not_import_each_other():
    wrong = [f"{a} imports {b}" for a, deps in graph().items() for b in deps
             if (component(a), component(b)) in NEVER]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_modules_or_packages():
    g = graph()
    assert cycle(g) is None, " -> ".join(cycle(g))
    packages: dict[str, set[str]] = {}
    for a, deps in g.items():
        packages.setdefault(component(a), set()).update(component(b) for b in deps if component(b) != component(a))
    assert cycle(packages) is None, " -> ".join(cycle(packages))


def test_the_checks_catch_what_they_guard():
    """The walk itself: an upward import and a cycle in a made-up graph are found."""
    assert layer("ember.cli.main") > layer("ember.train.loop") > layer("ember.ckpt.store") > layer("ember.errors")
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
    known = modules()
    assert "ember.train.loop" in imports(known["ember.launch"], known)  # a lazy import counts


def test_nothing_below_the_commands_prints():
    """Library code reports through ember.events; only the command layer writes to the terminal."""
    wrong = []
    for name, path in modules().items():
        if component(name) in LAYERS[5] | LAYERS[6]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                wrong.append(f"{name}:{node.lineno}: print()")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "write" and isinstance(node.func.value, ast.Attribute) \
                    and node.func.value.attr in ("stdout", "stderr"):
                wrong.append(f"{name}:{node.lineno}: writes to sys.{node.func.value.attr}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    a.name.startswith("rich") for a in node.names) or (
                    isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rich")):
                wrong.append(f"{name}:{node.lineno}: imports rich")
    assert not wrong, "\n".join(wrong)
