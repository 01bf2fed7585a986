"""What every benchmark shares: arguments, the naive eager baseline, timing, peak memory, and
RESULTS.md.

A benchmark script defines ``variant_names(args)`` and ``setup(args) -> Case``: the inputs on the
device and, per variant, a closure that runs the forward pass and returns the scalar to
differentiate. ``run`` measures every (variant, mode) with the same setup:

    forward   time of the forward pass (autograd graph built, as in training)
    backward  time of the backward pass alone (its forward runs untimed just before)
    full      time of forward + backward

Time: CUDA events on a GPU, perf_counter on the CPU; ``warmup`` untimed runs, then the median of
``repeats``. Peak extra memory: the most memory held at once during the timed runs minus what the
inputs hold (gradients of the inputs, outputs of the step, count as extra).
    CUDA  torch.cuda.max_memory_allocated() minus memory_allocated() after setup, in this process.
    CPU   (--memory) each variant runs in a fresh process (spawn) with glibc's mmap threshold pinned
          at 64 KiB, so freed tensors go back to the OS; the peak resident set (VmHWM, reset by
          writing 5 to /proc/self/clear_refs once the inputs exist) minus the resident set at that
          moment. A 1 GiB tensor measured the same way is printed with every table as a check of the
          method.

``--record`` appends the table to benchmarks/RESULTS.md under a header with the date, the machine,
the exact command and the commit. No figure in RESULTS.md is typed by hand.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import gc
import importlib.metadata
import math
import multiprocessing
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpo_ds.algo.policy_loss import LossConfig, token_losses
from grpo_ds.config import dtypes
from grpo_ds.config.software import resolve_backend, triton_problem

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "RESULTS.md"
MODES: tuple[str, ...] = ("forward", "backward", "full")
DTYPES = {name: getattr(torch, name) for name in dtypes.DTYPES}  # grpo_ds.config.dtypes names them
MIB = 2**20

RESULTS_HEADER = """# Benchmark results

Every block below was appended by a benchmark script run with `--record` (benchmarks/common.py); none is typed
by hand. Each names the machine, the exact command and the commit (`-dirty`: the work tree had uncommitted
changes, listed).

GPU, all benchmarks at the GPU shapes (16,384 tokens x hidden 4,096 x vocab 151,936 in bf16, Liger-Kernel's
fused linear GRPO loss when it is installed, copy bandwidth), one command from the repository root:

    bash benchmarks/run_gpu.sh

CPU peak memory at 4,096 tokens x vocab 151,936 (fp32 logits; fused linear with hidden 896), one command:

    bash benchmarks/run_cpu_memory.sh
"""  # noqa: E501


# ---------------------------------------------------------------------------------------- arguments


def base_parser(doc: str | None, modes: Sequence[str] = MODES) -> argparse.ArgumentParser:
    """Arguments every benchmark takes; the script adds its shapes and sets ``small`` (overrides of
    the shape arguments for the untimed small run that precedes each measurement) with
    parser.set_defaults."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="input dtype (default: bfloat16 on cuda, float32 on cpu)",
    )
    parser.add_argument(
        "--mode",
        default="full" if "full" in modes else modes[0],
        help=f"one of {', '.join(modes)}, or a comma-separated list",
    )
    parser.add_argument(
        "--backend",
        choices=("all", "auto", "torch", "triton"),
        default="all",
        help="grpo_ds.kernels backends to measure (all: every one that can run on the device); "
        "the eager baseline is always measured",
    )
    parser.add_argument(
        "--variants", default=None, help="comma-separated subset of the variants to run"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed runs (default: 3 cuda, 1 cpu, 0 cpu --memory)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs, median reported (default: 20 cuda, 3 cpu, 1 cpu --memory)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="cpu: measure peak memory, every variant in a fresh process (always measured on cuda)",
    )
    parser.add_argument(
        "--record", action="store_true", help="append the table to benchmarks/RESULTS.md"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(valid_modes=tuple(modes), small=None)
    return parser


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill device-dependent defaults and check the mode list."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda: no CUDA device is visible to torch here (use --device cpu)"
        )
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in args.valid_modes]
    if bad or not args.modes:
        raise SystemExit(
            f"--mode {args.mode!r}: choose from {', '.join(args.valid_modes)} (comma-separated)"
        )
    cpu_memory = args.device == "cpu" and args.memory
    if args.warmup is None:
        args.warmup = 3 if args.device == "cuda" else (0 if cpu_memory else 1)
    if args.repeats is None:
        args.repeats = 20 if args.device == "cuda" else (1 if cpu_memory else 3)
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")
    return args


def int_list(text: str) -> list[int]:
    """'1024,256' -> [1024, 256] (argparse type)."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, got {text!r}"
        )
    return values


def kernel_backends(args: argparse.Namespace) -> list[str]:
    """The grpo_ds.kernels backends to measure on args.device ("triton" runs on CPU only with
    TRITON_INTERPRET=1)."""
    if args.backend == "all":
        return ["torch"] + (["triton"] if triton_problem(args.device) is None else [])
    if args.backend == "auto":
        return [resolve_backend("auto", args.device)]
    if args.backend == "triton" and triton_problem(args.device) is not None:
        raise SystemExit(triton_problem(args.device))
    return [args.backend]


def select(names: list[str], args: argparse.Namespace) -> list[str]:
    """Apply --variants (a comma-separated subset) to the variant names."""
    if args.variants is None:
        return names
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in names]
    if unknown:
        raise SystemExit(
            f"--variants: unknown {', '.join(unknown)}; this run has {', '.join(names)}"
        )
    return [n for n in names if n in wanted]


# ------------------------------------------------------------------------- the naive eager baseline


def naive_logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What plain PyTorch code does: the full (N, V) float32 log-softmax, a gather, and -(p * log
    p).sum(-1)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V) float32
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N,)
    entropy = -(logp.exp() * logp).sum(dim=-1)  # (N,)
    return token_logp, entropy


def loss_config(entropy_coef: float) -> LossConfig:
    """The per-token loss every benchmark uses: DAPO clip-higher (0.2 / 0.28) and a k3 KL with
    coefficient 0.04."""
    return LossConfig(
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=None,
        kl_coef=0.04,
        kl_estimator="k3",
        entropy_coef=entropy_coef,
        policy_loss="ppo_clip",
    )


def weighted_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig,
) -> torch.Tensor:
    """sum_t w_t l_t with l_t from grpo_ds.algo.policy_loss.token_losses (w_t = mask / mask.sum():
    masked mean)."""
    per_token, _, _ = token_losses(logprobs, old, advantages, ref, entropy, cfg)  # (N,)
    return (per_token * weights).sum()


# ---------------------------------------------------------------------------------------- measuring


@dataclass
class Case:
    """Inputs built by a benchmark's setup, and per variant a closure running its forward pass."""

    variants: dict[str, Callable[[], torch.Tensor]]
    leaves: tuple[torch.Tensor, ...] = ()  # inputs that receive gradients (reset between runs)


@dataclass
class Measurement:
    variant: str
    mode: str
    times_ms: list[float] = field(default_factory=list)
    peak_mib: float | None = None  # peak extra memory
    error: str | None = None

    @property
    def ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.times_ms else None


class _Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.start, self.end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def _proc_status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    raise RuntimeError(f"{key} missing from /proc/self/status")


class _PeakMemory:
    """Peak extra memory from now on: CUDA allocator statistics, or the CPU process's resident-set
    high-water mark."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / MIB
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
            self.base = _proc_status_mib("VmRSS")

    def peak_extra_mib(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / MIB - self.base
        return _proc_status_mib("VmHWM") - self.base


def _reset(leaves: Sequence[torch.Tensor]) -> None:
    for t in leaves:
        t.grad = None
    gc.collect()


def _warm_libraries(device: str) -> None:
    """Load the math libraries' code and buffers (small ops) so that they are not counted as the
    variant's memory."""
    x = torch.randn(64, 256, device=device, requires_grad=True)
    w = torch.randn(128, 256, device=device, requires_grad=True)
    y = torch.log_softmax(x @ w.t(), dim=-1)
    (y.exp() * y).sum().backward()


def median_ms(fn: Callable[[], object], device: str, warmup: int = 2, repeats: int = 5) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on the GPU): the --sweep options' timer, short
    on purpose."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with _Timer(device) as timer:
            fn()
        times.append(timer.ms)
    return statistics.median(times)


def _run_once(fn: Callable[[], torch.Tensor], mode: str, device: str) -> float:
    """One forward / backward / forward + backward; returns the milliseconds of the timed part."""
    if mode == "forward":
        with _Timer(device) as timer:
            out = fn()
    elif mode == "backward":
        out = fn()
        with _Timer(device) as timer:
            out.backward()
    else:
        with _Timer(device) as timer:
            out = fn()
            out.backward()
    del out
    return timer.ms


def measure(
    setup: Callable[[argparse.Namespace], Case],
    args: argparse.Namespace,
    variant: str,
    mode: str,
    with_memory: bool,
) -> Measurement:
    """Build the inputs, then warm up and time ``variant`` in ``mode``, tracking peak memory over
    the timed runs.

    First the variant runs once at the script's small shapes (args.small), so that one-time costs
    (kernel compilation, lazily loaded code, library buffers) are neither timed nor counted as
    memory even without warmup runs at full size.
    """
    result = Measurement(variant, mode)
    torch.manual_seed(args.seed)
    try:
        _warm_libraries(args.device)
        if args.small:
            small = setup(argparse.Namespace(**{**vars(args), **args.small}))
            _run_once(small.variants[variant], mode, args.device)
            del small
        case = setup(args)
        fn = case.variants[variant]
        for i in range(args.warmup + args.repeats):
            _reset(case.leaves)
            if i == args.warmup and with_memory:
                meter = _PeakMemory(args.device)
            ms = _run_once(fn, mode, args.device)
            if i >= args.warmup:
                result.times_ms.append(ms)
        if with_memory:
            result.peak_mib = meter.peak_extra_mib()
    except torch.cuda.OutOfMemoryError as e:
        result.error = "out of memory: " + str(e).splitlines()[0][:120]
    return result


def _isolated(fn: Callable, *fn_args) -> object:
    """Run fn(*fn_args) in a fresh spawned process with glibc returning every freed block over
    64 KiB to the OS."""
    # read by the child's glibc at start; fixes the threshold
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            return pool.submit(fn, *fn_args).result()
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)


def _calibration_child(nbytes: int) -> float:
    _warm_libraries("cpu")
    meter = _PeakMemory("cpu")
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    del x
    return meter.peak_extra_mib()


def run(
    setup: Callable[[argparse.Namespace], Case], names: list[str], args: argparse.Namespace
) -> tuple[list[Measurement], list[str]]:
    """Measure every (variant, mode); returns the measurements and notes on the method."""
    notes: list[str] = []
    cpu_memory = args.device == "cpu" and args.memory
    with_memory = args.device == "cuda" or cpu_memory
    if cpu_memory:
        calibration = _isolated(_calibration_child, 2**30)
        notes.append(
            f"memory check: a 1,024 MiB tensor measured {calibration:,.0f} MiB by the same method"
        )
    results = []
    for mode in args.modes:
        for name in names:
            print(f"  measuring {name} {mode} ...", file=sys.stderr, flush=True)
            if cpu_memory:
                try:
                    results.append(_isolated(measure, setup, args, name, mode, True))
                except concurrent.futures.process.BrokenProcessPool:
                    results.append(Measurement(name, mode, error="process killed (out of memory?)"))
            else:
                results.append(measure(setup, args, name, mode, with_memory))
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    timing = f"warmup {args.warmup}, median of {args.repeats}"
    notes.append(f"time: {timing} ({'CUDA events' if args.device == 'cuda' else 'perf_counter'})")
    if cpu_memory:
        notes.append(
            "peak extra: VmHWM - VmRSS after setup, each variant in a fresh process (glibc mmap "
            "threshold 64 KiB, so times include first-touch page faults)"
        )
    elif args.device == "cuda":
        notes.append(
            "peak extra: torch.cuda.max_memory_allocated() - memory_allocated() after setup"
        )
    return results, notes


def copy_bandwidth(device: str, nbytes: int = 2**30, repeats: int = 10) -> float:
    """Bytes read + written per second by dst.copy_(src) of ``nbytes`` (median of ``repeats`` after
    2 warmups)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        with _Timer(device) as timer:
            dst.copy_(src)
        if i >= 2:
            times.append(timer.ms)
    return 2 * nbytes / (statistics.median(times) / 1e3)


# ---------------------------------------------------------------------------------------- reporting


def machine(device: str) -> str:
    """CPU model, cores, RAM, GPU (on cuda) and the versions that matter."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    parts = [f"{cpu}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads)"]
    try:
        ram_kib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024
        parts[0] += f", {ram_kib / 2**20:.0f} GiB RAM"
    except (ValueError, OSError):
        pass
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        parts.append(
            f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
        )
    versions = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for dist in ("triton", "liger-kernel"):
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return "; ".join(parts + [", ".join(versions)])


def commit() -> str:
    """Short hash of HEAD, with -dirty and the changed paths when the work tree differs from it. A
    copy of the work tree on another machine (a lent GPU machine) names its commit through
    GRPO_DS_COMMIT, which wins: the .git such a copy carries may be another checkout's."""
    if copied := os.environ.get("GRPO_DS_COMMIT"):
        return f"{copied} (as named by GRPO_DS_COMMIT: a copy of the work tree on another machine)"

    def git(*cmd: str) -> str:
        return subprocess.run(
            ["git", *cmd], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain").splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = [p for p in changed if p != "benchmarks/RESULTS.md"]
    if not changed:
        return head
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    return f"{head}-dirty (uncommitted: {shown})"


def command_line() -> str:
    env = [
        f"{k}={os.environ[k]}"
        for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST")
        if k in os.environ
    ]
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    return " ".join(env + ["python", shlex.quote(script)] + [shlex.quote(a) for a in sys.argv[1:]])


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def ratio_columns(
    results: list[Measurement], references: Sequence[str]
) -> tuple[list[str], list[list[str]]]:
    """Per reference variant r present in the same mode: speedup t_r / t and memory ratio m /
    m_r."""
    by_key = {(m.variant, m.mode): m for m in results}
    present = [r for r in references if any(m.variant == r and m.error is None for m in results)]
    headers = []
    for r in present:
        headers += [f"speedup vs {r}", f"mem / {r}"]
    rows = []
    for m in results:
        row = []
        for r in present:
            ref = by_key.get((r, m.mode))
            speed = ref.ms / m.ms if ref and ref.ms and m.ms else None
            mem = (
                m.peak_mib / ref.peak_mib
                if ref and ref.peak_mib and m.peak_mib is not None
                else None
            )
            row += [fmt(speed, 2) + ("x" if speed else ""), fmt(mem, 3)]
        rows.append(row)
    return headers, rows


def table(
    results: list[Measurement],
    references: Sequence[str] = ("eager",),
    extra: dict[str, Callable[[Measurement], str]] | None = None,
) -> str:
    """Markdown table: variant, mode, time, peak extra memory, ratios to the references, extra
    columns."""
    extra = extra or {}
    ratio_headers, ratio_rows = ratio_columns(results, references)
    headers = ["variant", "mode", "time ms", "peak extra MiB", *ratio_headers, *extra]
    rows = []
    for m, ratios in zip(results, ratio_rows, strict=True):
        if m.error:
            rows.append([m.variant, m.mode, m.error] + [""] * (len(headers) - 3))
            continue
        peak_digits = 0 if m.peak_mib is None or abs(m.peak_mib) >= 100 else 1
        rows.append(
            [
                m.variant,
                m.mode,
                fmt(m.ms, 2),
                fmt(m.peak_mib, peak_digits),
                *ratios,
                *(f(m) for f in extra.values()),
            ]
        )
    return markdown_table(headers, rows)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table with columns padded to their widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    line = lambda cells: (
        "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
    )
    return "\n".join(
        [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    )


def report(title: str, shape: str, device: str, body: str, notes: list[str], record: bool) -> None:
    """Print the table and notes; with ``record`` append them to RESULTS.md under date, machine,
    command, commit."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    block = "\n".join(
        [
            f"## {title}: {shape} ({stamp})",
            "",
            f"- machine: {machine(device)}",
            f"- command: `{command_line()}`",
            f"- commit: {commit()}",
            "",
            body,
            "",
            *[f"- {n}" for n in notes],
            "",
        ]
    )
    print("\n" + block)
    if record:
        if not RESULTS.exists():
            RESULTS.write_text(RESULTS_HEADER)
        with RESULTS.open("a") as f:
            f.write("\n" + block)
        print(f"appended to {os.path.relpath(RESULTS)}")


def chunk_fit(
    results: list[Measurement],
    prefix: str,
    mode: str,
    chunk_mib: Callable[[Measurement], float | None],
    held_mib: Callable[[Measurement], float],
) -> str | None:
    """Least-squares line held = a + k * (one chunk) over the chunk sizes measured for variants
    ``prefix``/<c>.

    ``a`` is the memory that does not depend on the chunk size, ``k`` how many chunk-sized tensors
    are alive at the peak. None when fewer than two chunk sizes have a memory figure.
    """
    points = [
        (chunk_mib(m), held_mib(m))
        for m in results
        if m.mode == mode
        and m.variant.startswith(prefix + "/")
        and m.peak_mib is not None
        and chunk_mib(m)
    ]
    if len({x for x, _ in points}) < 2:
        return None
    mean_x, mean_y = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    k = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points
    )
    return (
        f"{prefix} {mode}: fit over chunk sizes: {mean_y - k * mean_x:,.0f} MiB independent of the "
        f"chunk + {k:.2f} x one float32 chunk of logits"
    )


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"
