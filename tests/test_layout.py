"""The package's shape (README "How the code is laid out"): import rules, no circles, no module over 500 lines."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_ds"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The grpo_ds modules ``name`` imports, anywhere in the file (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_ds"):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                found.add(target if target in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("grpo_ds")}
    return found - {name}


GRAPH = {name: _imports(name) for name in MODULES}


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_no_import_circles():
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH.get(name, ())):
            if state.get(dep) == 1:
                pytest.fail("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep in GRAPH and not state.get(dep):
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if not state.get(name):
            visit(name, [name])


def test_no_module_is_over_500_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split by responsibility: {long}"


@pytest.mark.parametrize(("module", "may_import"), [
    ("grpo_ds.algo", ("grpo_ds.algo",)),
    ("grpo_ds.kernels", ("grpo_ds.algo", "grpo_ds.kernels")),
])
def test_the_math_imports_only_the_math(module, may_import):
    for name, deps in GRAPH.items():
        if _under(name, module):
            bad = {d for d in deps if not any(_under(d, allowed) for allowed in may_import)}
            assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize(("module", "never"), [
    ("grpo_ds.run.preflight", ("grpo_ds.distributed.ranks", "grpo_ds.model.policy", "grpo_ds.step.update", "grpo_ds.step.loss", "grpo_ds.train")),
    ("grpo_ds.step.loss", ("grpo_ds.distributed.ranks", "grpo_ds.model.policy", "grpo_ds.step.plan", "grpo_ds.step.update", "grpo_ds.train")),
    ("grpo_ds.train", ("grpo_ds.check",)),
])
def test_forbidden_imports(module, never):
    assert not GRAPH[module] & set(never), f"{module} imports {GRAPH[module] & set(never)}"


def test_nothing_imports_the_entry_points():
    for name, deps in GRAPH.items():
        assert not deps & {"grpo_ds.train", "grpo_ds.check"}, f"{name} imports an entry point"
