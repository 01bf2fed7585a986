"""The docs site stays true to the code: it builds with --strict, its generated pages and
transcripts are fresh, every recipe key is in the reference, every list renders as a list, and no
module cites a file outside the repository."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from html import unescape
from pathlib import Path

import pytest

from grpo_ds.config.recipe import iter_fields
from grpo_ds.config.reference import key_anchor
from tests import css_select
from tests.scripts.cli_forks import run_forked
from tests.shared_runs import docs_generate as _generate
from tests.shared_runs import tiny_recipe_run

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference" / "recipe.md"
REGENERATE = "regenerate the generated pages: python docs/generate.py"
IN_CI = os.environ.get("CI", "").lower() == "true"


def _docs_tool(module: str):
    """Import one of the docs tools (the docs extra, which the test extra pulls in); skip without
    it, except in CI, where a docs test that skips would let a broken site through."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if IN_CI:
            pytest.fail(
                f"CI=true and {module} is missing ({error}): CI must build the docs; "
                'install the docs tools: pip install -e ".[test]" (it pulls the docs extra)'
            )
        pytest.skip(f'{module} is not installed: pip install -e ".[docs]"')


def _schema_keys() -> list[str]:
    return [f"{section}.{f.name}" if section else f.name for section, f in iter_fields()]


# The reference gives each key a definition: the key alone on a line, in backticks, then its meaning
# after ":   ".
_DEFINED_KEY = re.compile(r"^`([A-Za-z_][\w.]*)`(?:\{#[\w.]+\})?\n:   \S", flags=re.MULTILINE)


def _defined_keys() -> list[str]:
    return _DEFINED_KEY.findall(REFERENCE.read_text(encoding="utf-8"))


def test_every_recipe_key_is_in_the_reference():
    defined = set(_defined_keys())
    missing = [key for key in _schema_keys() if key not in defined]
    assert not missing, f"docs/reference/recipe.md does not document {missing}; {REGENERATE}"


def test_the_reference_names_only_existing_keys():
    defined = _defined_keys()
    stale = sorted(set(defined) - set(_schema_keys()))
    assert defined and not stale, (
        f"docs/reference/recipe.md documents keys the schema does not have: {stale}"
    )
    assert len(defined) == len(set(defined)), "docs/reference/recipe.md defines a key twice"


def test_generated_pages_are_fresh():
    """The recipe reference, the command-line reference and the benchmarks page are what the code
    gives now."""
    assert not (stale := _generate().stale(transcripts=False)), f"stale: {stale}; {REGENERATE}"


@pytest.mark.slow
# its run is shared (tests/shared_runs.py): one worker makes it once
@pytest.mark.xdist_group("tiny_recipe_run")
def test_transcripts_are_the_consoles_of_real_runs():
    """Each console shown in the docs is run again (the tiny recipe, the dry run, bad input, a
    preempted run and its resume) and compared with the committed transcript, timings and versions
    masked."""
    generate = _generate()
    cwd = generate._scratch()
    # the commands alone run as forks of one process that imported the libraries
    # (tests/scripts/cli_forks.py): one import instead of one per command; stdout and stderr
    # interleaved, as generate.run_raw records them
    commands = [args for listed in generate.COMMANDS.values() for args, _ in listed]
    forked = run_forked(
        [(args[1:], cwd) for args in commands], generate._env(), cwd / "_forks", merged=True
    )
    outputs = {
        tuple(args): (done.returncode, done.stdout)
        for args, done in zip(commands, forked, strict=True)
    }
    for name, make in generate.TRANSCRIPTS.items():
        committed = generate.transcript_path(name).read_text()
        # shared with tests/test_train.py (tests/shared_runs.py): the same command, cwd, env
        if name == "train_tiny":
            fresh = tiny_recipe_run().transcript(expect=0)
        elif name in generate.COMMANDS:
            fresh = generate.commands_transcript(name, cwd, lambda args, _: outputs[tuple(args)])
        else:
            fresh = make(generate._scratch())
        assert generate.mask(committed) == generate.mask(fresh), (
            f"docs/transcripts/{name}.txt is stale; run: "
            f"python docs/generate.py --transcripts\n{fresh}"
        )


def test_masking_hides_only_what_differs_between_runs():
    mask = _generate().mask
    assert mask("step    1 reward_mean=0.1 tokens_per_s=5478 time_step_s=0.93") == mask(
        "step    1 reward_mean=0.1 tokens_per_s=12 time_step_s=7.1"
    )
    # a changed number is stale
    assert mask("step    1 reward_mean=0.1") != mask("step    1 reward_mean=0.2")
    # so is a changed key
    assert mask("step    1 reward_mean=0.1") != mask("step    1 reward_std=0.1")
    assert mask("step   25 reward_mean=0.1") != mask("step   25 reward_std=0.1")
    # later steps follow the rounding of MKL's per-CPU code path (a Xeon's and an EPYC's part after
    # ~100 tiny steps)
    assert mask("step  125 reward_mean=0.6737 loss=-0.002309") == mask(
        "step  125 reward_mean=0.6875 loss=-0.001394"
    )
    assert mask("step   10 reward_mean=0.1") == mask("step   10 reward_mean=0.2")
    assert mask("  torch         2.13.0+cpu (CPU build)") == mask("  torch         2.14.1+cu130")
    assert mask("preempted: stopped by SIGTERM after step 3 of 60") == mask(
        "preempted: stopped by SIGTERM after step 2 of 60"
    )


# Two ways Python-Markdown turns a list into something else. A list with no blank line before it
# joins the paragraph above, and each of its markers stays text at the start of a rendered line. A
# list nested by fewer than four spaces (two, say) is not nested at all: its items join the outer
# list, so the marker's indent is not a multiple of four.
_SURVIVING_MARKER = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+\S")
_SHALLOW_NESTING = re.compile(r"^( *)(?:[-*+]|\d+\.)\s+\S")
_FENCE = re.compile(r"^\s*(```|~~~)")
_PRE = re.compile(r"<pre\b.*?</pre>", flags=re.DOTALL)
_TAG = re.compile(r"<[^>]+>")


def _site_markdown():
    """Python-Markdown with the extensions mkdocs.yml gives the site (and MkDocs' own), snippets
    read from the root."""
    markdown, yaml = _docs_tool("markdown"), _docs_tool("yaml")
    _docs_tool("pymdownx")

    # mkdocs.yml may hold !!python/name or !ENV tags; none of them matter here
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)
    names, configs = ["toc", "tables", "fenced_code"], {}
    for entry in config.get("markdown_extensions", []):
        name, options = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        names.append(name)
        configs[name] = dict(options or {})
    configs.setdefault("pymdownx.snippets", {})["base_path"] = [str(ROOT)]
    return markdown.Markdown(extensions=list(dict.fromkeys(names)), extension_configs=configs)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _source_line(source: list[str], text: str) -> int | None:
    """The number of the source line that a surviving marker's rendered line came from (its first
    words match)."""
    marker, _, rest = text.strip().partition(" ")
    words = re.sub(r"[`*_]", "", rest).split()[:4]
    for n, line in enumerate(source, 1):
        plain = re.sub(r"[`*_]", "", line.strip())
        if line.strip().startswith(marker) and plain.split()[1:5] == words:
            return n
    return None


def broken_lists(page: Path, md) -> list[str]:
    """Where the page's lists do not render as lists, as 'page:line: text': each rendered line
    (outside <pre>) that starts with a list marker (a rendered item starts with <li>), and each item
    (outside code fences) nested by an indent that is not a multiple of four."""
    source = page.read_text(encoding="utf-8")
    lines, where = source.splitlines(), page.relative_to(ROOT)
    found = []
    for line in _PRE.sub("", md.reset().convert(source)).splitlines():
        if _SURVIVING_MARKER.match(line):
            shown = unescape(_TAG.sub("", line)).strip()
            found.append(
                f"{where}:{_source_line(lines, shown) or '?'}: "
                f"marker inside a paragraph: {shown[:80]}"
            )
    fenced = False
    for n, line in enumerate(lines, 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (item := _SHALLOW_NESTING.match(line)) and len(item.group(1)) % 4:
            found.append(
                f"{where}:{n}: nested by {len(item.group(1))} spaces, not 4: {line.strip()[:80]}"
            )
    return found


def _broken(md, text: str) -> list[str]:
    with tempfile.TemporaryDirectory(dir=ROOT) as folder:
        page = Path(folder) / "probe.md"
        page.write_text(text, encoding="utf-8")
        return broken_lists(page, md)


def test_the_list_checker_sees_a_list_rendered_as_text():
    md = _site_markdown()
    broken = {
        "no blank line": "Intro:\n- one\n- two\n",
        "two-space nesting": "- one\n  - inner\n- two\n",
        "numbered": "Steps:\n1. one\n2. two\n",
        "in an admonition": "!!! note\n    Intro:\n    - one\n",
        "nested in an admonition": "!!! note\n    - one\n      - inner\n",
    }
    for what, text in broken.items():
        assert _broken(md, text), what
    good = (
        "Intro:\n\n- one\n    - inner\n- two\n\n1. first\n"
        "\n```\n- in a code block\n  - nested\n```\n"
    )
    assert md.reset().convert(good).count("<li>") == 4 and not _broken(md, good)


def test_every_list_renders_as_a_list():
    """Every page (docs/ and the README), rendered with the site's Markdown extensions, has no list
    marker left in a paragraph or item: a list needs a blank line before it and four-space
    nesting."""
    md = _site_markdown()
    found = [hit for page in _pages() for hit in broken_lists(page, md)]
    assert not found, (
        "a list renders as text (add a blank line before it; nest by four spaces):\n"
        + "\n".join(found)
    )


LAUNCH = {"docs/snippets/launch.txt": "```\n{}```", "docs/snippets/launch.py": "```python\n{}```"}


@pytest.mark.parametrize("snippet", LAUNCH)
def test_the_ways_to_launch_have_one_source(snippet):
    """The launch commands (and the Python call) live in docs/snippets/; the home page and
    getting-started include them, and the README, which GitHub shows without snippets, holds a
    verbatim copy."""
    text = (ROOT / snippet).read_text(encoding="utf-8")
    assert text.strip(), snippet
    block = LAUNCH[snippet]
    assert block.format(text) in (ROOT / "README.md").read_text(encoding="utf-8"), (
        f"README.md's launch block differs from {snippet}: "
        "copy the file's text into the README's block"
    )
    for page in ("docs/index.md", "docs/getting-started.md"):
        assert block.format(f'--8<-- "{snippet}"\n') in (ROOT / page).read_text(encoding="utf-8"), (
            f"{page} should include {snippet} as a code block"
        )


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    """mkdocs build --strict of the docs, once for this module's tests."""
    _docs_tool("mkdocs")
    _docs_tool("material")
    _docs_tool("mkdocstrings_handlers.python")
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return site


def test_the_docs_build_with_strict(built_site):
    """mkdocs build --strict: a broken link, a missing anchor, a snippet that is not there or a
    docstring that does not render fails the build."""
    assert (built_site / "index.html").is_file()


def _selectors_setting(declaration: str) -> list[str]:
    """The selectors of docs/stylesheets/extra.css's rules whose body matches ``declaration`` (a
    regular expression), comments left out."""
    css = re.sub(
        r"/\*.*?\*/", "", (ROOT / "docs" / "stylesheets" / "extra.css").read_text(), flags=re.S
    )
    return [
        selector.strip()
        for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css)
        if re.search(declaration, body)
        for selector in selectors.split(",")
    ]


def test_no_code_block_of_the_built_site_is_kept_on_one_line(built_site):
    """No rule of docs/stylesheets/extra.css that sets white-space: nowrap reaches a code block (a
    pre > code) of any built page: one that did rendered the vLLM guide's four launch commands in a
    list item as one line. The selectors are matched by css_select (descendant and child
    combinators, types, classes, :not(type))."""
    nowrap = _selectors_setting(r"white-space:\s*nowrap")
    assert nowrap, "extra.css has no nowrap rule: nothing to check"
    blocks = 0
    for page in built_site.rglob("*.html"):
        tree = css_select.parse(page.read_text())
        blocks += sum(
            1 for e in css_select.elements(tree) if e.tag == "code" and e.parent.tag == "pre"
        )
        for selector in nowrap:
            hit = [e for e in css_select.select(tree, selector) if e.parent.tag == "pre"]
            assert not hit, f"{page.relative_to(built_site)}: {selector!r} reaches a code block"
    assert blocks > 100, blocks  # the check saw the site's code blocks


def test_every_code_block_of_the_built_site_wraps_its_long_lines(built_site):
    """A rule of docs/stylesheets/extra.css that sets white-space: pre-wrap reaches every code block
    (pre > code) of every built page, so a line longer than the column wraps inside it instead of
    running past its edge (checked on the built HTML and the stylesheet, not in a browser); and the
    table of contents sits in the navigation (toc.integrate), which gives the text column the
    right-hand sidebar's width."""
    wrapping = _selectors_setting(r"white-space:\s*pre-wrap")
    blocks = 0
    for page in built_site.rglob("*.html"):
        tree = css_select.parse(page.read_text())
        reached = {id(e) for selector in wrapping for e in css_select.select(tree, selector)}
        for e in css_select.elements(tree):
            if e.tag == "code" and e.parent.tag == "pre":
                blocks += 1
                assert id(e) in reached, (
                    f"{page.relative_to(built_site)}: a code block does not wrap"
                )
    assert blocks > 100, blocks  # the check saw the site's code blocks
    assert "toc.integrate" in (ROOT / "mkdocs.yml").read_text()


def test_every_picture_opens_full_size(built_site):
    """Each picture of a page is a link to the picture itself, so a reader on a phone can open it
    at its own size (the pictures are wider than a phone's column)."""
    pictures = 0
    for page in built_site.rglob("*.html"):
        for img in css_select.select(css_select.parse(page.read_text()), "article img"):
            pictures += 1
            link = img.parent
            assert link.tag == "a" and link.attrs.get("href") == img.attrs.get("src"), (
                f"{page.relative_to(built_site)}: {img.attrs.get('src')} is not a link to itself"
            )
    assert pictures >= 6, pictures  # the benchmarks page's three, architecture's two, placement's


def test_every_recipe_key_has_an_id_on_the_reference_page(built_site):
    """Guides link a key to its definition: recipe.md#rollout.max_staleness."""
    page = css_select.parse((built_site / "reference" / "recipe" / "index.html").read_text())
    ids = {element.attrs.get("id") for element in css_select.select(page, "dt code")}
    missing = [key for key in _schema_keys() if key_anchor(key) not in ids]
    assert not missing and len(_schema_keys()) > 100, missing


def test_every_guides_key_list_links_each_key_to_its_definition():
    """A guide's first paragraph names the keys it relies on: each links to the reference's id for
    it (a key left unlinked, or linked to the page alone, fails)."""
    lists = 0
    for page in sorted((ROOT / "docs" / "guides").glob("*.md")):
        found = re.search(
            r"relies on the keys(.*?)\(\[recipe reference\]", page.read_text(), flags=re.S
        )
        if not found:
            continue
        lists += 1
        text = found.group(1)
        bare = re.findall(r"(?<!\[)`([a-z_]+\.[\w.\[\]]+)`(?!\])", text)
        linked = re.findall(r"\[`([^`]+)`\]\(\.\./reference/recipe\.md#([\w.]+)\)", text)
        assert not bare, f"{page.name}: keys without a link: {bare}"
        assert linked and all(anchor == key_anchor(key) for key, anchor in linked), page.name
    assert lists >= 8, lists


def test_no_file_cites_a_document_outside_the_repository():
    """The project's own docs hold its design; nothing points a reader at a file they do not
    have."""
    outside = re.compile(r"DESIGN\.md|STYLE\.md|\.\./shared|shared/notes")
    found = []
    for folder in ("grpo_ds", "tests", "benchmarks", "docs", "recipes", "notebooks"):
        for path in (ROOT / folder).rglob("*"):
            if (
                path.is_file()
                and path.suffix in (".py", ".md", ".json", ".ipynb", ".sh", ".txt", ".yml")
                and path != Path(__file__).resolve()
            ):
                found += [
                    f"{path.relative_to(ROOT)}:{n}"
                    for n, line in enumerate(path.read_text(errors="ignore").splitlines(), 1)
                    if outside.search(line)
                ]
    found += [
        f"README.md:{n}"
        for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert not found, f"cites a file outside the repository: {found}"
