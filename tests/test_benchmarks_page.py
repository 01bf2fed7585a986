"""The benchmarks page answers first: docs/generate.py reads benchmarks/RESULTS.md into one summary
row per question (the latest block, its figure and its targets), reports a block it cannot read
instead of dropping it, keeps the full log on an archive page, and keeps the pages and pictures
fresh."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import markdown
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location(
        "docs_generate_bench", ROOT / "docs" / "generate.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _vs_trl(
    date: str, commit: str, verdicts: str, machine: bool = True, ratio: str = "0.66x"
) -> str:
    return "\n".join(
        [
            "## bench_vs_trl: builtin:tiny, builtin:arith, "
            f"25 prompts x 32 completions, cpu ({date} UTC)",
            "",
            *(
                ["- machine: AMD EPYC, 2 cores (2 torch threads), 24 GiB RAM; python 3.11.7"]
                if machine
                else []
            ),
            "- command: `python benchmarks/bench_vs_trl.py --record`",
            f"- commit: {commit}",
            "",
            "| trainer | runs | reward @ 100 | reward @ 200 |",
            "|---|---|---|---|",
            "| grpo_ds | 3 | 0.1 | 0.9 |",
            "| TRL GRPOTrainer | 3 | 0.2 | 0.8 |",
            "",
            f"- grpo_ds / TRL: step time {ratio}, peak memory 0.91x, final reward 0.936 vs 0.926",
            f"- target (grpo_ds ahead): {verdicts}",
            "",
        ]
    )


OLD = _vs_trl("2026-11-01 10:00", "aaaaaaa", "time per step met, memory met", ratio="0.50x")
NEW = _vs_trl("2026-11-02 10:00", "bbbbbbb", "time per step NOT met, memory met", ratio="1.20x")


def _rows(generate, *texts: str):
    _, found = generate.blocks("# Benchmark results\n\npreamble\n\n" + "\n".join(texts))
    rows, unasked = generate.summary(found)
    return {row.question.title: row for row in rows}, unasked, found


def test_the_summary_shows_the_latest_block_per_question_and_its_verdicts(generate):
    rows, unasked, _ = _rows(generate, OLD, NEW)
    row = rows["Speed and memory vs TRL, CPU, tiny model"]
    assert row.block.index == 2 and row.unreadable is None
    assert (
        row.figure
        == "grpo_ds / TRL: step time 1.20x, peak memory 0.91x, final reward 0.936 vs 0.926"
    )
    assert [(t.what, t.met) for t in row.targets] == [
        ("grpo_ds ahead: time per step", False),
        ("grpo_ds ahead: memory", True),
    ]
    table = generate.summary_table(list(rows.values()))
    targets = generate.targets_table(list(rows.values()))
    line, verdicts = (
        next(
            x for x in t.splitlines() if x.startswith("| Speed and memory vs TRL, CPU, tiny model")
        )
        for t in (table, targets)
    )
    assert "`bbbbbbb`" in line and "AMD EPYC, 2 cores" in line and "NOT met" not in line
    assert "**NOT met**: grpo_ds ahead: time per step" in verdicts and "`bbbbbbb`" in verdicts
    assert "0.50x" not in table  # the older block is in the archive only
    # the top of the page: the ratio in words, lower being better
    (measured,) = generate.vs_trl(list(rows.values()))
    assert measured[1:] == (1.20, 0.91)
    top = generate.vs_trl_table(list(rows.values()))
    assert "| CPU, tiny model | 1.20x slower | 1.1x less memory |" in top
    rows, _, _ = _rows(generate, NEW, OLD)  # the order appended decides, not the order of the dates
    assert rows["Speed and memory vs TRL, CPU, tiny model"].block.heading.endswith(
        "(2026-11-01 10:00 UTC)"
    )
    assert not unasked


def test_a_reward_model_block_answers_reward_models_only_with_both_issue_36_verdicts(generate):
    """bench_vs_trl --reward-model's heading also names the 151,936 vocabulary: its row is "Reward
    models", the realistic row keeps its own block, and the issue-36 list gives one verdict per
    target."""
    realistic = _vs_trl("2026-11-02 10:00", "ccccccc", "time per step met, memory met").replace(
        "builtin:tiny, builtin:arith, 25 prompts x 32 completions",
        "random Qwen2 43 M (hidden 256, 4 layers, vocabulary "
        "151,936), builtin:arith, 8 prompts x 8 completions",
    )
    rm = realistic.replace(
        "vocabulary 151,936), builtin:arith",
        "vocabulary 151,936), with a reward model (a "
        "sequence classifier of the same shape, its own tokenizer of 105 tokens), builtin:arith",
    )
    rm = rm.replace("(2026-11-02 10:00 UTC)", "(2026-11-03 10:00 UTC)").replace(
        "- target (grpo_ds ahead)",
        "- target (issue 36, reward model): grpo_ds peak memory 0.59x TRL's (at most "
        "0.6x: 1,610 vs 2,734 MiB) met, grpo_ds step time 0.85x TRL's (at most 0.8x: 52.764 vs "
        "62.000 s) NOT met\n"
        "- target (grpo_ds ahead)",
    )
    rows, unasked, _ = _rows(generate, realistic, rm)
    assert rows["Reward models"].block.heading.endswith("(2026-11-03 10:00 UTC)")
    assert rows["Speed and memory vs TRL, CPU, vocabulary 151,936"].block.heading.endswith(
        "(2026-11-02 10:00 UTC)"
    )
    issue = [
        (t.what, t.met) for t in rows["Reward models"].targets if t.what.startswith("issue 36")
    ]
    assert issue == [
        (
            "issue 36, reward model: grpo_ds peak memory "
            "0.59x TRL's (at most 0.6x: 1,610 vs 2,734 MiB)",
            True,
        ),
        (
            "issue 36, reward model: grpo_ds step time "
            "0.85x TRL's (at most 0.8x: 52.764 vs 62.000 s)",
            False,
        ),
    ]
    assert not unasked


def test_questions_without_a_block_say_not_measured_yet(generate):
    rows, _, _ = _rows(generate, NEW)
    for title in (
        "Placement: colocated vs split S=0 vs S=1 (CPU, real vLLM)",
        "Reward models",
        "Speed and memory vs TRL, GPU, 0.5 B",
    ):
        assert rows[title].block is None and rows[title].figure == "not measured yet"
    table = generate.summary_table(list(rows.values()))
    assert "| Reward models | not measured yet |" in table


def test_a_block_the_parser_cannot_read_is_reported_not_dropped(generate, tmp_path, monkeypatch):
    """The latest block of a question lacks its machine line and the figure's line: the row shows
    that block as unreadable (it does not fall back to the older block), and the page says so; a
    block no question asks for is listed on the page."""
    broken = _vs_trl("2026-11-03 10:00", "ccccccc", "memory met", machine=False).replace(
        "- grpo_ds / TRL:", "- "
    )
    stray = (
        "## bench_something_new: a new benchmark (2026-11-04 10:00 UTC)\n\n- machine: x\n"
        "- command: `y`\n"
        "- commit: z\n"
    )
    rows, unasked, found = _rows(generate, OLD, broken, stray)
    row = rows["Speed and memory vs TRL, CPU, tiny model"]
    assert row.block.index == 2
    assert "no '- machine:' line" in row.unreadable and "figure not found" in row.unreadable
    assert [b.heading for b in unasked] == [found[2].heading]
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\npreamble\n\n" + "\n".join([OLD, broken, stray]))
    monkeypatch.setattr(generate, "RESULTS", results)
    page = generate.benchmarks_page()
    assert "**unreadable block**: no '- machine:' line" in page
    assert "Blocks the page could not read" in page and "block #2" in page
    assert f"[#3 bench_something_new](benchmarks-archive.md#{found[2].anchor})" in page


def test_targets_are_read_in_each_form_the_benchmarks_write(generate):
    block = generate.Block(
        1,
        "x",
        "\n".join(
            [
                "## x",
                "",
                "- chunked/512 full: extra memory 0.225 of eager's (target <= 0.25): met",
                "- target (every seed's last-10 reward >= 0.9, in under 60 s of training): NOT met",
                "- packed is 1.66x faster (target 1.3x): met; peak "
                "memory 0.51x the padded one's (target below 1): NOT met",
                "- after / before: 0.976; target (not worse by more than 3%): met",
                "- target (grpo_ds ahead): time per step met, reward "
                "at equal samples (every point and final) NOT met",
                "- target (issue 38): grpo_ds step time <= "
                "0.6x TRL's (median of 3/3 runs): 0.47x, met",
                "- target (issue 38): grpo_ds lean bf16 peak GPU memory "
                "<= TRL's: 1.08x (11,606 vs 10,765 MiB), NOT met",
                "- a note that states no verdict",
                "",
                "| configuration | within 25% |",
                "|---|---|",
                "| ZeRO-3 | met |",
                "| ZeRO-3 + tp=2 | NOT met |",
                "",
            ]
        ),
    )
    assert [(t.what, t.met) for t in block.targets] == [
        ("chunked/512 full: extra memory 0.225 of eager's (target <= 0.25)", True),
        ("every seed's last-10 reward >= 0.9, in under 60 s of training", False),
        ("packed is 1.66x faster (target 1.3x)", True),
        ("peak memory 0.51x the padded one's (target below 1)", False),
        ("not worse by more than 3%", True),
        ("grpo_ds ahead: time per step", True),
        ("grpo_ds ahead: reward at equal samples (every point and final)", False),
        ("issue 38: grpo_ds step time <= 0.6x TRL's (median of 3/3 runs): 0.47x", True),
        (
            "issue 38: grpo_ds lean bf16 peak GPU memory <= TRL's: 1.08x (11,606 vs 10,765 MiB)",
            False,
        ),
        ("ZeRO-3: within 25%", True),
        ("ZeRO-3 + tp=2: within 25%", False),
    ]


def test_a_target_line_without_a_verdict_is_an_error_not_a_silent_drop(generate):
    block = generate.Block(1, "x", "## x\n\n- target (issue 38): grpo_ds step time 0.47x TRL's\n")
    with pytest.raises(ValueError, match="states no verdict"):
        _ = block.targets


def test_every_block_of_results_is_on_the_archive_and_every_link_finds_its_heading(generate):
    """The archive holds each block once; each summary link's anchor is an id the site's toc gives a
    heading."""
    _, found = generate.blocks(generate.RESULTS.read_text())
    archive = generate.benchmarks_archive_page()
    assert all(archive.count(b.text) == 1 for b in found)
    md = markdown.Markdown(extensions=["tables", "toc"])
    rendered = md.convert(archive)
    ids = {f'id="{b.anchor}"' in rendered for b in found}
    assert ids == {True}
    rows, unasked = generate.summary(found)
    assert not unasked, "every block of RESULTS.md answers a question of the summary"
    assert [r.question.title for r in rows if r.unreadable] == []


def test_short_machine_names(generate):
    assert (
        generate.short_machine("AMD EPYC, 2 cores (2 torch threads), 24 GiB RAM; python 3.11.7")
        == "AMD EPYC, 2 cores"
    )
    assert (
        generate.short_machine(
            "Intel(R) Xeon(R) Processor, 16 cores (16 torch threads), 126 GiB RAM; NVIDIA "
            "H200 (140 GiB), CUDA 13.0; python 3.12.3"
        )
        == "NVIDIA H200"
    )


def test_the_pictures_exist_and_the_pages_show_them(generate):
    pages = "".join(
        (ROOT / "docs" / page).read_text()
        for page in ("benchmarks.md", "concepts/architecture.md", "guides/placement.md")
    )
    for name in generate.PICTURES:
        data = (ROOT / "docs" / "img" / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), name
        assert set(generate.png_text(data)) >= {"Software", "Source"}, name
        assert f"img/{name})" in pages, f"no page shows docs/img/{name}"


def test_stale_covers_the_archive_the_pictures_and_their_data(generate, tmp_path, monkeypatch):
    """A copy of docs/ is fresh; after changing the archive, a picture and the tiny run's recipe,
    stale() names each of them."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    monkeypatch.setattr(generate, "DOCS", docs)
    monkeypatch.setattr(generate, "IMG", docs / "img")
    monkeypatch.setattr(generate, "TINY_DATA", docs / "img" / "tiny_cpu")
    assert generate.stale(transcripts=False) == []
    (docs / "benchmarks-archive.md").write_text("edited by hand\n")
    (docs / "img" / "reward_vs_trl.png").write_bytes(
        (docs / "img" / "architecture.png").read_bytes()
    )
    recipe = docs / "img" / "tiny_cpu" / "recipe.json"
    recipe.write_text(recipe.read_text().replace('"lr": 0.001', '"lr": 0.002'))
    found = generate.stale(transcripts=False)
    assert "benchmarks-archive.md" in found
    assert "img/reward_vs_trl.png (drawn from other data)" in found
    assert any(f.startswith("img/tiny_cpu/ (its recipe.json is not today's") for f in found), found
    assert "img/tiny_cpu_curves.png (drawn from other data)" in found  # its data changed too


def test_a_picture_drawn_by_another_matplotlib_is_named_not_failed(generate, monkeypatch):
    monkeypatch.setattr(generate, "_matplotlib_version", lambda: "0.0.1")
    found, unchecked = generate.stale_pictures()
    assert not found
    assert len(unchecked) == len(generate.PICTURES) and "pixels are not compared" in unchecked[0]


def test_a_ratio_in_words_says_which_way_is_better(generate):
    assert generate.times(0.45, "faster", "slower") == "2.2x faster"
    assert generate.times(1.43, "less memory", "more memory") == "1.43x more memory"
    assert generate.times(1.0, "faster", "slower") == "1.0x faster"
