"""The package's shape (docs/concepts/architecture.md): its parts, what each may import, no circles,
no long modules.

A part is a sub-package (config, distributed, model, step, run, algo, kernels, rewards,
reward_models, envs, rollout) or a top-level module (the CLIs train, check, export, plot; errors;
and session, the run's parts). Imports are read from the source (inside functions too); imports
under ``if TYPE_CHECKING:`` are annotations only: they do not count for what a part may import, but
they do for circles between modules (a module that needs another's types for its annotations depends
on it).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_ds"
MAX_LINES = 500
MAX_DRIVER_LINES, MAX_LOOP_LINES = 250, 80  # grpo_ds/train.py and its loop, _train
MAX_FUNCTION_LINES = 60
# The functions allowed more than MAX_FUNCTION_LINES lines, each with the reason.
LONG_FUNCTIONS = {
    "grpo_ds.train._train": "the driver loop: a step's phases top to bottom, in one place to read "
    "(MAX_LOOP_LINES bounds it)",
    "grpo_ds.kernels.policy_loss._rows": "a Triton kernel: one program's loads, token math and "
    "stores over a row, its parameters one per line",
    "grpo_ds.kernels.fused_linear._policy_loss_rows": "a Triton kernel: one program's pass over a "
    "row of logits, its parameters one per line",
    "grpo_ds.kernels.chunked.PolicyLossFromHidden.forward": "an autograd forward: one loop over "
    "the chunks, whose buffers are freed inside it as it goes",
}
PARTS = (
    "config",
    "distributed",
    "model",
    "step",
    "run",
    "algo",
    "kernels",
    "rewards",
    "reward_models",
    "envs",
    "rollout",
)
ENTRY_POINTS = ("train", "launch", "check", "export", "plot")  # python -m grpo_ds.<name>
TOP_LEVEL = (*ENTRY_POINTS, "errors", "session", "__init__")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _type_checking_only(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, annotations: bool = False):
    """Every import statement, skipping the bodies of ``if TYPE_CHECKING:`` unless
    ``annotations``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node) and not annotations:
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(name: str, prefix: str = "grpo_ds", annotations: bool = False) -> set[str]:
    """The modules ``name`` imports whose names start with ``prefix`` (grpo_ds modules by default);
    with ``annotations``, those imported for type annotations only as well."""
    found = set()
    for node in _import_nodes(ast.parse(MODULES[name].read_text()), annotations):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                found.add(target if target in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(prefix)}
    return found - {name}


GRAPH = {name: _imports(name) for name in MODULES}
GRAPH_WITH_ANNOTATIONS = {name: _imports(name, annotations=True) for name in MODULES}


def _part(name: str) -> str:
    """grpo_ds.model.policy -> "model"; grpo_ds.train -> "train"; grpo_ds -> "__init__"."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep in graph and not state.get(dep):
                if found := visit(dep, path + [dep]):
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node) and (found := visit(node, [node])):
            return found
    return None


def test_the_top_level_shows_the_parts():
    """`ls grpo_ds/` is the architecture: the sub-packages, the CLIs, errors and the session;
    nothing else at the top."""
    top = {p.stem for p in PACKAGE.glob("*.py")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert top == set(TOP_LEVEL), (
        f"modules at the top that belong to a part: {top - set(TOP_LEVEL)}"
    )
    assert packages == set(PARTS)
    for part in PARTS:  # each part says what it holds
        assert ast.get_docstring(ast.parse((PACKAGE / part / "__init__.py").read_text())), part


def test_no_import_circles():
    """Not even through imports made for annotations only: such a circle works at run time, but each
    module of it needs the others to be read (config.recipe once called config.rules, which needed
    the schema's types)."""
    assert (circle := _circle(GRAPH_WITH_ANNOTATIONS)) is None, "import circle: " + " -> ".join(
        circle
    )


def test_no_circles_between_parts():
    parts: dict[str, set[str]] = {}
    for name, deps in GRAPH.items():
        parts.setdefault(_part(name), set()).update(
            _part(d) for d in deps if _part(d) != _part(name)
        )
    parts.pop("__init__", None)  # the public surface imports its names lazily, from every part
    assert (circle := _circle(parts)) is None, "circle between parts: " + " -> ".join(circle)


def test_no_module_is_over_500_lines():
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split by responsibility: {long}"


def _function_lengths(path: Path) -> dict[str, int]:
    """Each function's (and method's) lines, from its ``def`` (decorators excluded) to its last
    line."""
    tree = ast.parse(path.read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    child.qualname = f"{node.name}.{child.name}"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[getattr(node, "qualname", node.name)] = node.end_lineno - node.lineno + 1
    return out


def test_the_driver_reads_in_one_screen_or_two():
    """The driver (grpo_ds/train.py) is the command line and the loop; the run's parts open in
    grpo_ds/session.py and each phase lives in grpo_ds/step/."""
    path = MODULES["grpo_ds.train"]
    assert len(path.read_text().splitlines()) <= MAX_DRIVER_LINES
    assert _function_lengths(path)["_train"] <= MAX_LOOP_LINES


def test_no_function_is_over_60_lines():
    long = {
        f"{name}.{function}": n
        for name, path in MODULES.items()
        for function, n in _function_lengths(path).items()
        if n > MAX_FUNCTION_LINES
    }
    unexplained = {name: n for name, n in long.items() if name not in LONG_FUNCTIONS}
    assert not unexplained, (
        f"split into named steps, or add to LONG_FUNCTIONS with the reason: {unexplained}"
    )
    stale = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not stale, f"LONG_FUNCTIONS names functions that are no longer long (or gone): {stale}"


def test_the_function_rule_sees_a_long_function(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"class C:\n    def f(self):\n{body}\n")
    assert _function_lengths(tmp_path / "m.py") == {"C.f": MAX_FUNCTION_LINES + 1}


# What each part may import of grpo_ds (prefixes); "*" entries of the other rules below.
MAY_IMPORT = {
    "grpo_ds.algo": ("grpo_ds.algo",),
    "grpo_ds.kernels": ("grpo_ds.algo", "grpo_ds.kernels"),
    "grpo_ds.distributed": ("grpo_ds.distributed",),
    "grpo_ds.errors": ("grpo_ds.distributed.launcher",),
    "grpo_ds.config": (
        "grpo_ds.config",
        "grpo_ds.algo.names",
        "grpo_ds.errors",
        "grpo_ds.distributed.launcher",
    ),
    "grpo_ds.rewards": ("grpo_ds.rewards", "grpo_ds.config", "grpo_ds.errors"),
    "grpo_ds.envs": ("grpo_ds.envs", "grpo_ds.rewards", "grpo_ds.errors"),
    "grpo_ds.rollout": (
        "grpo_ds.rollout",
        "grpo_ds.envs",
        "grpo_ds.config",
        "grpo_ds.errors",
        "grpo_ds.distributed",
    ),
}


@pytest.mark.parametrize("part", sorted(MAY_IMPORT))
def test_what_each_lower_part_imports(part):
    for name, deps in GRAPH.items():
        if _under(name, part):
            bad = {d for d in deps if not any(_under(d, allowed) for allowed in MAY_IMPORT[part])}
            assert not bad, f"{name} imports {bad}"


# What a part never imports (prefixes). With MAY_IMPORT, the table docs/generate.py draws the
# architecture from.
NEVER_IMPORT = (
    # the model is built and used, it does not drive
    ("grpo_ds.model", ("grpo_ds.step", "grpo_ds.run")),
    ("grpo_ds.reward_models", ("grpo_ds.step", "grpo_ds.run")),  # below the step, which holds them
    ("grpo_ds.run", ("grpo_ds.step",)),  # the run's files know nothing of a step's phases
    ("grpo_ds.run.preflight", ("grpo_ds.model.engine", "grpo_ds.model.policy")),  # loads no model
    (
        "grpo_ds.step.loss",
        ("grpo_ds.distributed", "grpo_ds.model", "grpo_ds.step.plan", "grpo_ds.step.update"),
    ),
    ("grpo_ds.train", ("grpo_ds.check",)),  # the driver never imports the dry-run report
)


@pytest.mark.parametrize(("part", "never"), NEVER_IMPORT)
def test_forbidden_imports(part, never):
    for name, deps in GRAPH.items():
        if _under(name, part):
            bad = {d for d in deps if any(_under(d, forbidden) for forbidden in never)}
            assert not bad, f"{name} imports {bad}"


def test_nothing_imports_the_entry_points():
    entry = {f"grpo_ds.{e}" for e in ENTRY_POINTS}
    for name, deps in GRAPH.items():
        assert not deps & entry, f"{name} imports an entry point: {deps & entry}"


def test_configuration_and_the_public_surface_import_no_torch():
    """Loading and checking a recipe (grpo_ds.config), the formulas' names and `import grpo_ds` need
    no torch, so that they are fast and work where torch is broken; checked by importing them in a
    fresh interpreter."""
    config = sorted(name for name in MODULES if _under(name, "grpo_ds.config"))
    code = (
        "import sys, grpo_ds, grpo_ds.algo.names, grpo_ds.distributed.launcher, grpo_ds.errors\n"
        + "".join(f"import {name}\n" for name in config)
        + "grpo_ds.Recipe, grpo_ds.load_recipe, grpo_ds.UserError\n"
        + "print(sorted(m for m in ('torch', 'deepspeed', "
        "'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    ).stdout
    assert out.strip() == "[]", f"importing the configuration pulled in {out.strip()}"


def _calls(name: str):
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Call):
            yield node


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE"}


def test_the_launchers_variables_are_read_in_one_place():
    """Only grpo_ds.distributed reads RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_SIZE; everything else
    asks it."""
    for name, path in MODULES.items():
        if _under(name, "grpo_ds.distributed"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if (
                isinstance(node, ast.Call)
                and _dotted(node.func) in ("os.environ.get", "os.getenv")
                and node.args
            ):
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and _dotted(node.value) == "os.environ":
                key = node.slice
            elif isinstance(node, ast.Compare) and any(
                _dotted(c) == "os.environ" for c in node.comparators
            ):
                key = node.left
            if isinstance(key, ast.Constant) and key.value in LAUNCHER_VARIABLES:
                pytest.fail(f"{name} reads {key.value}: use grpo_ds.distributed.launcher")


def test_one_free_port_helper_and_one_atomic_write():
    """A free port comes from grpo_ds.distributed.launcher.free_port, a small file is replaced
    atomically by grpo_ds.run.writes.write_atomic: nothing else in the package, the tests or the
    benchmarks defines its own."""
    root = PACKAGE.parent
    for path in [
        *PACKAGE.rglob("*.py"),
        *(root / "tests").rglob("*.py"),
        *(root / "benchmarks").glob("*.py"),
    ]:
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        where = path.relative_to(root)
        if where != Path("grpo_ds/distributed/launcher.py"):
            assert not defined & {"free_port", "_free_port"}, f"{where} defines its own free port"
        if where != Path("grpo_ds/run/writes.py") and path.is_relative_to(PACKAGE):
            replaces = [
                n
                for n in ast.walk(tree)
                if isinstance(n, ast.Call) and _dotted(n.func) == "os.replace"
            ]
            assert not replaces, (
                f"{where} replaces a file itself: use grpo_ds.run.writes.write_atomic"
            )


def _package_modules():
    for name, path in MODULES.items():
        yield name, path.relative_to(PACKAGE.parent), ast.parse(path.read_text())


DTYPE_NAMES = {"float32", "bfloat16", "float16"}


def test_dtype_names_are_mapped_in_one_place():
    """A table of dtype names (a dict, tuple, list or set literal naming two or more of them) is
    written only in grpo_ds.config.dtypes; everything else imports its names."""
    for name, where, tree in _package_modules():
        if name == "grpo_ds.config.dtypes":
            continue
        for node in ast.walk(tree):
            items = (
                node.keys
                if isinstance(node, ast.Dict)
                else node.elts
                if isinstance(node, (ast.Tuple, ast.List, ast.Set))
                else []
            )
            named = {
                i.value for i in items if isinstance(i, ast.Constant) and i.value in DTYPE_NAMES
            }
            assert len(named) < 2, (
                f"{where}:{node.lineno} writes a table of dtype names: use grpo_ds.config.dtypes"
            )


def test_the_accelerator_variable_is_read_and_defaulted_in_one_place():
    """DS_ACCELERATOR (DeepSpeed's accelerator choice) is read and defaulted only by
    grpo_ds.distributed.launcher (``cpu_forced``, ``use_cpu_accelerator``)."""
    for name, where, tree in _package_modules():
        if name != "grpo_ds.distributed.launcher":
            named = [
                n.lineno
                for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and n.value == "DS_ACCELERATOR"
            ]
            assert not named, (
                f"{where}:{named[0]} uses DS_ACCELERATOR: use grpo_ds.distributed.launcher"
            )


def test_folders_are_renamed_into_place_in_one_place():
    """A folder written under a temporary name is fsynced and renamed into place by
    grpo_ds.run.writes (``folder_written``, ``publish_folder``): nothing else renames. The one
    exception, grpo_ds.run.lock, renames a stale lock file away to take it over (a rename succeeds
    once: that is its lock, not a write)."""
    allowed = {"grpo_ds.run.writes": {"os.rename", "os.replace"}, "grpo_ds.run.lock": {"os.rename"}}
    for name, where, tree in _package_modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            called = _dotted(node.func)
            if (
                called.endswith(".rename")
                and not called.startswith("os.")
                or called in ("os.rename", "os.replace")
            ):
                what = "os.rename" if called.endswith(".rename") else called
                assert what in allowed.get(name, ()), (
                    f"{where}:{node.lineno} calls {called}: write the "
                    "folder with grpo_ds.run.writes.folder_written"
                )


# print() is the command lines' own output (their report, table or written path, on stdout); a
# message for the user goes through grpo_ds.distributed.launcher.say (stderr, rank 0 only). The
# sandbox runner is another process that must not import grpo_ds: its stderr is what it tells the
# parent.
PRINTS = {
    "grpo_ds.check",
    "grpo_ds.launch",
    "grpo_ds.export",
    "grpo_ds.plot",
    "grpo_ds.config.reference",
}
PRINTS_TO_STDERR = {"grpo_ds.distributed.launcher", "grpo_ds.rewards.sandbox_runner"}


def test_messages_go_through_say_and_only_the_command_lines_print():
    for name, where, tree in _package_modules():
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "print"
            ):
                continue
            to = next((_dotted(k.value) for k in node.keywords if k.arg == "file"), "sys.stdout")
            allowed = PRINTS_TO_STDERR if to == "sys.stderr" else PRINTS
            assert name in allowed, (
                f"{where}:{node.lineno} prints to {to}: a message for the user goes through "
                "grpo_ds.distributed.launcher.say (rank 0, stderr)"
            )
