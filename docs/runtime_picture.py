"""The runtime picture of docs/concepts/architecture.md: a run's processes and what travels
between them.

Two panels, each one launch of 8 ranks: colocated, and split with 2 rollout ranks. ``facts`` takes
from the code what the code holds: each rank's role and the panels' titles from
grpo_ds.config.placement.resolve_placement for an example recipe; the rollout engine, its
tensor-parallel groups and the weight bucket from that recipe; the engines a recipe may choose from
the schema; the bridge's messages from grpo_ds.distributed.messages (their class names, and who
sends each, from its docstring). The reward workers sit beside the first rank that collects samples,
and the learned reward models on every rank that trains (grpo_ds/session.py opens them there).
docs/generate.py draws the picture into docs/img/runtime.png (``draw``) and hashes ``sources``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = "recipes/vllm_gsm8k_qwen2.5_7b_8gpu.json"  # 8 GPUs, vLLM tensor parallel 2
WORLD = 8
SPLIT = (
    'rollout.placement="split"',
    "rollout.ranks=2",
    "rollout.max_staleness=1",
    "rollout.vllm_sleep_mode=false",
)  # split refuses it: a rollout rank holds no trainer


class Message(NamedTuple):
    """One lane of the bridge in the picture: a kind of grpo_ds.distributed.messages (or a run of
    kinds that share their words, WeightBucket... WeightsEnd)."""

    name: str  # the class name(s)
    what: str  # its words (WHAT) where they say more than the name; else ""
    to_trainer: bool  # from the first rollout rank to the trainer's rank 0; else broadcast by it
    when: str


# How often each kind of message travels, in the order the lanes are drawn (the sender is read from
# each class's docstring).
WHEN = {
    "Layout": "once",
    "Batch": "each step",
    "Start": "once",
    "GoAhead": "each step",
    "WeightBucket": "bucket by bucket",
    "WeightsEnd": "",
    "Stop": "once",
}
TO_TRAINER_DOC, FROM_TRAINER_DOC = "The first rollout rank -> the trainer", "The trainer -> "
# between rollout ranks, not across the bridge's two sides: not a lane of the picture
SIDEWAYS = {"Share"}


def _messages() -> tuple[Message, ...]:
    """The bridge's lanes from grpo_ds.distributed.messages: each kind, its sender, how often."""
    from grpo_ds.distributed.messages import KINDS

    if set(KINDS) - SIDEWAYS != set(WHEN):
        raise ValueError(
            f"grpo_ds.distributed.messages has the kinds {sorted(set(KINDS) - SIDEWAYS)}; "
            f"docs/runtime_picture.py's WHEN has {sorted(WHEN)}: draw each"
        )
    lanes: list[Message] = []
    for name in WHEN:
        kind, doc = KINDS[name], KINDS[name].__doc__ or ""
        if not doc.startswith((TO_TRAINER_DOC, FROM_TRAINER_DOC)):
            raise ValueError(
                f"{name}'s docstring does not start with who sends it "
                f"({TO_TRAINER_DOC!r} or {FROM_TRAINER_DOC!r})"
            )
        to_trainer = doc.startswith(TO_TRAINER_DOC)
        previous = lanes[-1] if lanes else None
        if (
            previous
            and KINDS[previous.name.split("... ")[-1]].WHAT == kind.WHAT
            and previous.to_trainer == to_trainer
        ):  # the same words: one lane
            lanes[-1] = previous._replace(name=f"{previous.name}... {name}")
        else:
            said = kind.WHAT.replace("-", "").lower() not in name.lower()
            lanes.append(Message(name, kind.WHAT if said else "", to_trainer, WHEN[name]))
    return tuple(lanes)


class Panel(NamedTuple):
    title: str  # Placement.describe()
    command: str  # the launch
    roles: tuple[str, ...]  # Placement.role of each rank
    engines: tuple[tuple[int, int], ...]  # (first, last) rank of each rollout engine
    engine: str  # the engine's label
    trainer_ranks: int


class Facts(NamedTuple):
    colocated: Panel
    split: Panel
    bucket_mb: float  # rollout.weight_sync_bucket_mb
    engine_choices: tuple[str, ...]  # rollout.engine's choices
    messages: tuple[Message, ...]


def _panel(overrides: tuple[str, ...]) -> Panel:
    from grpo_ds import load_recipe
    from grpo_ds.config.placement import resolve_placement

    with contextlib.chdir(REPO):
        recipe = load_recipe(EXAMPLE, list(overrides))
    placement = resolve_placement(recipe, WORLD)
    roles = tuple(placement.role(r) for r in range(WORLD))
    generating = [r for r in range(WORLD) if roles[r] != "trainer"]
    tp = recipe.rollout.vllm_tensor_parallel_size if recipe.uses_vllm else 1
    engines = tuple((generating[i], generating[i + tp - 1]) for i in range(0, len(generating), tp))
    engine = f"{recipe.rollout.engine} engine" + (f"\ntensor parallel {tp}" if tp > 1 else "")
    command = f"python -m grpo_ds.launch --num_gpus {WORLD} --module grpo_ds.train {EXAMPLE}"
    if overrides:
        command += "\n" + " ".join(overrides)
    return Panel(placement.describe(), command, roles, engines, engine, placement.trainer_ranks)


def facts() -> Facts:
    from grpo_ds import load_recipe
    from grpo_ds.config.recipe import RolloutConfig

    with contextlib.chdir(REPO):
        bucket = load_recipe(EXAMPLE).rollout.weight_sync_bucket_mb
    engine = next(f for f in dataclasses.fields(RolloutConfig) if f.name == "engine")
    return Facts(_panel(()), _panel(SPLIT), bucket, engine.metadata["choices"], _messages())


def sources() -> bytes:
    return repr(facts()).encode()


# ----------------------------------------------------------------------------------------- drawing

TRAIN, ENGINE, REWARD, PROCESS = "#dbe6f7", "#e3f2dc", "#fbeed5", "#f4f4f4"
TO_TRAINER, FROM_TRAINER = "#a0522d", "#1f4e9a"
X0 = -3.0  # the row labels' column starts here; rank r's column is [r, r + 1)
SMALL, TEXT = 8.5, 9.5  # font sizes (points)
LANE = 0.5  # the height of one message's lane on the bridge
FIRST_LANE = 1.3


def _box(ax, x0, y0, x1, y1, text="", face=PROCESS, dashed=False, size=TEXT):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(
        FancyBboxPatch(
            (x0, y0),
            x1 - x0,
            y1 - y0,
            boxstyle="round,pad=0,rounding_size=0.08",
            facecolor=face,
            edgecolor="0.35",
            linewidth=1.0,
            linestyle="--" if dashed else "-",
        )
    )
    if text:
        ax.text((x0 + x1) / 2, (y0 + y1) / 2, text, ha="center", va="center", fontsize=size)


def _arrow(ax, start, end, color="black", width=1.2):
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops=dict(
            arrowstyle="-|>", color=color, linewidth=width, shrinkA=0, shrinkB=0, mutation_scale=11
        ),
    )


def _label(ax, y, text):
    """A row's explanation, in the column left of the ranks."""
    ax.text(X0, y, text, ha="left", va="center", fontsize=TEXT, color="0.15")


def _draw_panel(ax, panel: Panel, facts: Facts) -> None:
    roles, split = panel.roles, "rollout" in panel.roles
    trainers = [r for r, role in enumerate(roles) if role != "rollout"]
    rollout = [r for r, role in enumerate(roles) if role == "rollout"]
    ax.set_title(panel.title, fontsize=11, loc="left", weight="bold")
    # the launcher and the processes it starts
    _box(ax, 0.05, 10.25, WORLD - 0.05, 11.1, panel.command, size=SMALL)
    _label(ax, 10.68, "the launcher")
    for r in range(WORLD):
        _arrow(ax, (r + 0.5, 10.25), (r + 0.5, 9.75), color="0.45", width=0.8)
    _label(ax, 9.9, "starts a process per GPU:\na rank")
    _label(ax, 8.3, "DeepSpeed ZeRO-3 engine:\nthe rank's shard of weights,\ngradients, optimizer")
    choices = facts.engine_choices
    engines = f"{', '.join(choices[:-1])}\nor {choices[-1]}"
    _label(ax, 6.45, f"rollout engine: {engines} (rollout.engine)")
    _label(ax, 5.3, "learned reward models\n(reward.models), if any")
    for r, role in enumerate(roles):
        _box(ax, r + 0.05, 4.7, r + 0.95, 9.75)
        ax.text(
            r + 0.5, 9.55, f"rank {r}\n{role}", ha="center", va="top", fontsize=TEXT, weight="bold"
        )
        if role == "rollout":
            ax.text(
                r + 0.5,
                8.25,
                "no ZeRO-3,\nno\noptimizer",
                ha="center",
                va="center",
                fontsize=SMALL,
                color="0.4",
            )
        else:
            shard = f"ZeRO-3\nshard\n1/{panel.trainer_ranks}"
            _box(ax, r + 0.12, 7.75, r + 0.88, 8.75, shard, TRAIN)
            _box(ax, r + 0.12, 4.85, r + 0.88, 5.8, "reward\nmodels", REWARD, dashed=True)
    for first, last in panel.engines:
        _box(ax, first + 0.12, 6.05, last + 0.88, 7.0, panel.engine, ENGINE)
    if split:
        _label(ax, 7.35, f"weights: gathered from the\n{len(trainers)} shards, sent by rank 0")
    else:  # each rank writes the weights it gathers into its own engine
        for r in trainers:
            _arrow(ax, (r + 0.5, 7.75), (r + 0.5, 7.0))
        _label(ax, 7.35, f"weights, bucket by bucket\n({facts.bucket_mb:g} MB), after each step")
    # the reward workers, beside the first rank that collects
    lead = (rollout or trainers)[0]
    _box(ax, lead + 0.05, 2.85, lead + 0.7, 3.85, "reward\nworkers", REWARD)
    _arrow(ax, (lead + 0.25, 4.7), (lead + 0.25, 3.85))
    _arrow(ax, (lead + 0.5, 3.85), (lead + 0.5, 4.7))
    ax.text(
        lead + (0.75 if split else 0.8),
        3.35,
        "completions ↓\nrewards ↑",
        ha="left",
        va="center",
        fontsize=SMALL,
    )
    _label(
        ax, 3.35, f"reward worker processes\n(reward.processes) score\nrank {lead}'s completions"
    )
    # the process groups
    if split:
        groups = [
            (
                trainers,
                "trainer group: ZeRO-3's gathers, each batch from rank 0,\n"
                "the reward models' scores",
            ),
            (rollout, "rollout group:\nsamples gathered"),
        ]
    else:
        groups = [
            (
                trainers,
                f"one group of {WORLD} ranks: the prompts from rank 0, the samples "
                "gathered, the rewards from rank 0,\nZeRO-3's gathers",
            )
        ]
    for ranks, text in groups:
        _box(ax, ranks[0] + 0.05, 1.7, ranks[-1] + 0.95, 2.6, text, size=SMALL)
    _label(ax, 2.15, "process groups\n(NCCL on GPUs)")
    if split:
        _draw_bridge(ax, rollout, facts.messages)


def _draw_bridge(ax, rollout: list[int], messages: tuple[Message, ...]) -> None:
    """The trainer's rank 0 and every rollout rank: one lane per message, below the groups."""
    bottom = FIRST_LANE - LANE * (len(messages) - 1)
    for r in [0, *rollout]:
        ax.plot([r + 0.86, r + 0.86], [4.7, bottom], color="0.25", linewidth=1.0, zorder=1)
    _label(
        ax,
        (FIRST_LANE + bottom) / 2,
        "the bridge: rank 0 and\n"
        f"ranks {rollout[0]}-{rollout[-1]}\n(a process group\nof their own)",
    )
    for i, m in enumerate(messages):
        y = FIRST_LANE - LANE * i
        if m.to_trainer:
            _arrow(ax, (rollout[0] + 0.86, y), (0.86, y), color=TO_TRAINER)
            who = f"rank {rollout[0]} → rank 0"
        else:
            for r in rollout:
                _arrow(ax, (0.86, y), (r + 0.86, y), color=FROM_TRAINER)
            who = f"rank 0 → ranks {rollout[0]}-{rollout[-1]}"
        said = f": {m.what}" if m.what else ""
        ax.text(
            1.0,
            y + 0.05,
            f"{m.name}{said}  ({m.when}; {who})",
            ha="left",
            va="bottom",
            fontsize=TEXT,
            color=TO_TRAINER if m.to_trainer else FROM_TRAINER,
            bbox=dict(facecolor="white", edgecolor="none", pad=0.3),
        )


def draw():
    """The two panels, colocated above split."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    f = facts()
    top_y, low = 11.2, FIRST_LANE - LANE * len(f.messages)
    fig = Figure(figsize=(11.0, 13.0), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    colocated, split = fig.subplots(2, 1, height_ratios=(top_y - 1.6, top_y - low))
    _draw_panel(colocated, f.colocated, f)
    _draw_panel(split, f.split, f)
    colocated.set_ylim(1.6, top_y)
    split.set_ylim(low, top_y)
    for ax in (colocated, split):
        ax.set_xlim(X0 - 0.05, WORLD + 0.05)
        ax.set_axis_off()
    return fig
