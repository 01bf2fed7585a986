"""The code's maps stay true: each package's ``__init__`` docstring names its modules, every
repository path (``grpo_ds/...``, ``tests/...``) and dotted name (``grpo_ds.x.y``) written in the
sources, the docs and setup.cfg exists, and no file names a module that moved by its old bare name.

Names are checked statically (files and ``ast``), so that a name in an optional module (vLLM) is
checked without importing it.
"""

import ast
import functools
import glob
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "grpo_ds"
SUBPACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


# ------------------------------------------------------------------------------------- package maps


def _named(docstring: str, package: str, module: str) -> bool:
    """A map names a module as ``module`` (an RST literal, the maps' style), ``package.module`` in a
    literal, or by its full dotted name grpo_ds.package.module anywhere. A bare word is not enough:
    ``logprobs`` is named, but logprobs_from_logits does not name the module logprobs."""
    literal = re.compile(rf"``(?:(?:grpo_ds\.)?{package}\.)?{module}``")
    dotted = re.compile(rf"(?<![\w.])grpo_ds\.{package}\.{module}(?!\w)")
    return bool(literal.search(docstring) or dotted.search(docstring))


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_each_package_map_names_each_of_its_modules(package):
    folder = PACKAGE / package
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    missing = [m for m in modules if not _named(docstring, package, m)]
    assert not missing, f"grpo_ds/{package}/__init__.py's docstring does not name {missing}"


def test_the_map_rule_sees_a_missing_module():
    """The rule above is not vacuous: a literal names a module, a longer identifier containing it
    does not."""
    assert _named("the plan (``plan``)", "step", "plan")
    assert _named("see grpo_ds.step.plan.", "step", "plan")
    assert not _named("``plan_recipe_step`` plans", "step", "plan")
    assert not _named("grpo_ds.step.planner", "step", "plan")


# ------------------------------------------------------------------------------- names that resolve

# A path starts with grpo_ds/ or tests/ after a character that cannot belong to a longer path or
# word, and goes on through path characters; each of its parts starts with a letter or "_" (a
# module, a folder, a test file: none of them starts with a digit, so a table label such as
# "grpo_ds/16" is not a path). "*" makes it a glob.
PATH = re.compile(r"(?<![\w.\-/])(?:grpo_ds|tests)(?:/[A-Za-z_*][\w.*\-]*)+/?")
DOTTED = re.compile(r"(?<![\w./])grpo_ds(?:\.[A-Za-z_]\w*)+")


def _generated_pages() -> set[str]:
    """The pages docs/generate.py writes (its PAGES keys): each is checked at its source (the recipe
    schema, the command lines' help, benchmarks/RESULTS.md), and rewritten from it."""
    tree = ast.parse((REPO / "docs" / "generate.py").read_text())
    assigned = {}  # module-level name -> its value's node (a key may be a constant such as ARCHIVE)
    for node in tree.body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if isinstance(target, ast.Name):
            assigned[target.id] = node.value
    pages = assigned.get("PAGES")
    assert isinstance(pages, ast.Dict), "docs/generate.py has no PAGES dict"
    return {
        f"docs/{ast.literal_eval(assigned[key.id] if isinstance(key, ast.Name) else key)}"
        for key in pages.keys
    }


# benchmarks/RESULTS.md is a dated log: each block names the commit it was measured on and the files
# as they were at that commit (an uncommitted file list, a "matched" line), so its paths are true of
# their commit, not of today. The scripts that write the blocks are .py files and are checked.
DATED_LOGS = {"benchmarks/RESULTS.md"}
THIS_FILE = "tests/test_maps.py"  # its examples (test_the_name_rule) name missing paths on purpose


def _checked_files() -> list[str]:
    """Tracked *.py, *.md and *.ipynb files and setup.cfg (git's list: no generated site, no run
    folders)."""
    listed = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.ipynb", "setup.cfg"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    skip = DATED_LOGS | _generated_pages() | {THIS_FILE}
    return [name for name in listed if name not in skip and (REPO / name).is_file()]


def _path_exists(path: str) -> bool:
    if "*" in path:
        return bool(glob.glob(str(REPO / path), recursive=True))
    return (REPO / path).exists()


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body defines: functions, classes, assignments and imports, including
    those under a top-level ``if``/``try`` (optional imports)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update(
                {n.id: node for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            )
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (
                node.body,
                node.orelse,
                getattr(node, "finalbody", []),
                *[h.body for h in getattr(node, "handlers", [])],
            ):
                out.update(_defined(block))
    return out


@functools.cache
def _body(path: Path) -> list[ast.stmt]:
    return ast.parse(path.read_text()).body


def _module_file(parts: list[str]) -> Path | None:
    base = REPO.joinpath(*parts)
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _lazy_names() -> dict[str, str]:
    """grpo_ds/__init__.py's public names, imported on first use: name -> the module that defines
    it."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_PUBLIC" for t in node.targets
        ):
            return {
                k.value: v.value for k, v in zip(node.value.keys, node.value.values, strict=True)
            }
    raise AssertionError("grpo_ds/__init__.py has no _PUBLIC dict")


def _resolves(dotted: str) -> bool:
    """grpo_ds.a.b.C.d resolves when its longest module prefix is a file of the package and each
    further part is defined in the module or class before it. A part after a function or a value (an
    attribute of an object) cannot be read from the source and is taken as is; grpo_ds.X follows the
    lazily exported names."""
    parts = dotted.split(".")
    cut = max(i for i in range(1, len(parts) + 1) if _module_file(parts[:i]))
    module, rest = _module_file(parts[:cut]), parts[cut:]
    if cut == 1 and rest:
        lazy = _lazy_names()
        if rest[0] not in lazy:
            return False
        module = _module_file(lazy[rest[0]].split("."))
    body = _body(module)
    for name in rest:
        node = _defined(body).get(name)
        if node is None:
            return False
        if not isinstance(node, ast.ClassDef):
            return True
        body = node.body
    return True


def _stale(name: str, text: str) -> list[str]:
    """ "file:line: path ..." or "file:line: name ..." for each path or dotted name in ``text`` that
    does not resolve."""
    found = []
    for match in PATH.finditer(text):
        path = match.group(0).rstrip(".")  # a sentence's full stop
        if not _path_exists(path):
            found.append(f"{name}:{text.count(chr(10), 0, match.start()) + 1}: path {path}")
    for match in DOTTED.finditer(text):
        if not _resolves(match.group(0)):
            found.append(
                f"{name}:{text.count(chr(10), 0, match.start()) + 1}: name {match.group(0)}"
            )
    return found


def test_every_path_and_dotted_name_resolves():
    files = _checked_files()
    assert "setup.cfg" in files and "README.md" in files and "grpo_ds/train.py" in files
    stale = [line for name in files for line in _stale(name, (REPO / name).read_text())]
    assert not stale, "names that do not resolve (moved or removed?):\n" + "\n".join(stale)


def _identifiers() -> set[str]:
    """Every name the tracked Python files define or use (variables, attributes, arguments,
    functions, imports)."""
    found: set[str] = set()
    for name in subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.split():
        for node in ast.walk(ast.parse((REPO / name).read_text())):
            if isinstance(node, ast.Name):
                found.add(node.id)
            elif isinstance(node, ast.Attribute):
                found.add(node.attr)
            elif isinstance(node, ast.arg):
                found.add(node.arg)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
            elif isinstance(node, ast.alias):
                found.update((node.asname or node.name).split("."))
            elif isinstance(node, ast.keyword) and node.arg:
                found.add(node.arg)
    return found


def _retired_modules() -> set[str]:
    """The names of grpo_ds modules that were removed or renamed (git's history), where the name can
    only mean the module: it has an underscore (a compound name, not an English word such as "data"
    or "environment"), no Python file uses it as a name (``ds_config`` is also a variable, so a
    mention may be that), and no tracked file's name holds it (benchmarks/bench_weight_sync.py keeps
    "weight_sync" a subject of its own)."""
    git = ["git", "log", "--format=", "--name-status", "--diff-filter=DR", "--", "grpo_ds"]
    log = subprocess.run(git, cwd=REPO, check=True, capture_output=True, text=True).stdout
    old = {
        Path(line.split("\t")[1]).stem
        for line in log.splitlines()
        if line.endswith(".py") and "\t" in line
    }
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    in_use = {name for name in old if name in tracked} | _identifiers()
    return {name for name in old if "_" in name} - in_use


def test_no_file_names_a_retired_module():
    """A module that moved leaves no mention of its old name behind (a bare word, not a path or
    dotted name: "ds_config_check says so")."""
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if shallow == "true":
        pytest.skip("a shallow clone has not the history that says which modules moved")
    retired = _retired_modules()
    # the layout change's renames are seen
    assert {"ds_config_check", "recipe_parse", "step_data"} <= retired
    words = re.compile(r"\b(" + "|".join(sorted(retired)) + r")\b")
    found = []
    for name in _checked_files():
        text = (REPO / name).read_text()
        found += [
            f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            for m in words.finditer(text)
        ]
    assert not found, "names of modules that moved or were removed:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("text", "stale"),
    [
        ("see grpo_ds/step/plan.py and tests/step/test_plan.py.", []),
        ("see grpo_ds/planner.py", ["path grpo_ds/planner.py"]),
        ("tests/test_update.py pins it", ["path tests/test_update.py"]),
        ("tests/**/*_gpu.py need a GPU", []),
        ("| grpo_ds/16 | 51.1 |", []),  # a table label, not a path
        ("my_tests/x.py and /tmp/grpo_ds.log", []),  # part of another path or word
        ("grpo_ds.step.plan.plan_recipe_step and grpo_ds.load_recipe", []),
        ("grpo_ds.distributed.ranks.Dist.decide", []),  # a class attribute
        ("grpo_ds.lora.PEFT_SPEC", ["name grpo_ds.lora.PEFT_SPEC"]),
        ("grpo_ds.batching", ["name grpo_ds.batching"]),
        ("grpo_ds.step.plan.no_such_function", ["name grpo_ds.step.plan.no_such_function"]),
        (
            "grpo_ds.distributed.ranks.Dist.no_such_method",
            ["name grpo_ds.distributed.ranks.Dist.no_such_method"],
        ),
        ("grpo_ds.NoSuchName", ["name grpo_ds.NoSuchName"]),
    ],
)
def test_the_name_rule(text, stale):
    """The rule above finds what moved and passes what is there."""
    assert [line.split(": ", 1)[1] for line in _stale("example.md", text)] == stale


# ---------------------------------------------------------------------------- the architecture page

ARCHITECTURE = REPO / "docs" / "concepts" / "architecture.md"
RUNTIME_PICTURE = "../img/runtime.png"  # drawn by docs/runtime_picture.py (docs/generate.py)


def _module_paths() -> list[str]:
    """Every module file of the package (not ``__init__.py``) as the page names it: its path under
    grpo_ds/, ``step/plan.py`` or ``train.py``."""
    return sorted(
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    )


def _literal_paths(page: str) -> set[str]:
    """The ``.py`` paths the page writes as code literals, without a leading ``grpo_ds/``."""
    return set(re.findall(r"`(?:grpo_ds/)?([\w/]+\.py)`", page))


def _unnamed(page: str, modules: list[str]) -> list[str]:
    """The modules the page does not name as a literal `step/plan.py` or `grpo_ds/step/plan.py`."""
    named = _literal_paths(page)
    return [m for m in modules if m not in named]


def _not_modules(page: str, modules: list[str]) -> list[str]:
    """The modules of a sub-package that the page names and the package does not hold (moved?)."""
    return sorted(
        p for p in _literal_paths(page) if p.split("/")[0] in SUBPACKAGES and p not in modules
    )


def _opens_with(page: str, image: str) -> bool:
    """The page's first picture is ``image``, shown before its first heading after the title."""
    title, _, body = page.partition("\n")
    section = re.search(r"^#{1,6} ", body, re.M)
    opening = body[: section.start()] if section else body
    pictures = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page)
    return title.startswith("# ") and pictures[:1] == [image] and f"]({image})" in opening


def test_the_architecture_page_names_every_module():
    """docs/concepts/architecture.md names every module of the package, and only modules that are
    there."""
    page, modules = ARCHITECTURE.read_text(), _module_paths()
    assert {"train.py", "step/schedule.py", "distributed/bridge.py"} <= set(modules)
    missing = _unnamed(page, modules)
    assert not missing, f"docs/concepts/architecture.md does not name {missing}"
    moved = _not_modules(page, modules)
    assert not moved, f"docs/concepts/architecture.md names modules that are not there: {moved}"


def test_the_architecture_page_opens_with_the_runtime_picture():
    assert _opens_with(ARCHITECTURE.read_text(), RUNTIME_PICTURE), (
        f"docs/concepts/architecture.md's first picture, before its first section, is not "
        f"{RUNTIME_PICTURE}"
    )


def test_the_architecture_rules_see_a_missing_module_and_a_late_picture():
    """The rules above are not vacuous: a bare word, a longer name or another folder does not name
    a module; a picture after the first section, or after another picture, does not open the
    page."""
    modules = ["train.py", "step/plan.py"]
    assert _unnamed("`train.py` and `grpo_ds/step/plan.py`", modules) == []
    assert _unnamed("`train.py`, `step/plan.py`", modules) == []
    assert _unnamed(
        "`train.py`, step/plan.py, `step/planner.py`, `plan.py`, `run/plan.py`", modules
    ) == ["step/plan.py"]
    assert _not_modules(
        "`step/plan.py`, `step/planner.py`, `docs/generate.py`, `x_gpu.py`", modules
    ) == ["step/planner.py"]
    shown = "![the runtime](../img/runtime.png)"
    assert _opens_with(
        f"# T\n\nText.\n\n{shown}\n\n## Parts\n\n![b](../img/b.png)\n", RUNTIME_PICTURE
    )
    assert not _opens_with(f"# T\n\nText.\n\n## Parts\n\n{shown}\n", RUNTIME_PICTURE)
    assert not _opens_with(f"# T\n\n![b](../img/b.png)\n\n{shown}\n\n## Parts\n", RUNTIME_PICTURE)
    assert not _opens_with("# T\n\nNo picture.\n", RUNTIME_PICTURE)
