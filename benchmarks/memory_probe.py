"""Run grpo_ds.train in this process and record this rank's anonymous resident memory, per phase.

    [deepspeed --num_gpus N] benchmarks/memory_probe.py OUT_JSON RECIPE.json [section.key=value ...]

A thread samples /proc/self/status (RssAnon) every 5 ms. The baseline is taken after the imports,
before the run (the libraries); the driver's phases are marked by wrapping the functions that run
them (the session's rollout engine construction, Policy.build, collect, logprob_pass,
optimizer_step),
so each phase's peak is known; the rest (weight sync, logging, checkpoints) counts as "start". Each
rank writes OUT_JSON with ``.rank<r>`` appended: {"baseline_mib", "peak_mib", "phases": {phase: peak
MiB}, "after_build_mib"} (all RssAnon, MiB). Run it with MALLOC_MMAP_THRESHOLD_=131072 so freed
buffers go back to the OS (glibc's mallopt M_MMAP_THRESHOLD).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import grpo_ds.session as session
import grpo_ds.step.schedule as schedule
import grpo_ds.step.update  # noqa: F401  (imported before the baseline, like every library the run uses)
import grpo_ds.train as driver
from grpo_ds.model.policy import Policy


def rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Sampler:
    def __init__(self) -> None:
        self.phase = "start"
        self.peaks: dict[str, float] = {}
        self.marks: dict[str, list[float]] = {}
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop:
            now = rss_anon_mib()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), now)
            time.sleep(0.005)

    def wrap(self, owner, name: str, phase: str) -> None:
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            before, self.phase = self.phase, phase
            try:
                return real(*args, **kwargs)
            finally:
                now = rss_anon_mib()
                self.peaks[phase] = max(self.peaks.get(phase, 0.0), now)
                self.marks.setdefault(f"after {phase}", []).append(round(now, 1))
                self.phase = before

        setattr(owner, name, wrapped)


def main(out: str, recipe: str, overrides: list[str]) -> None:
    sampler = Sampler()
    time.sleep(0.05)
    baseline = rss_anon_mib()
    sampler.wrap(schedule, "collect", "rollout")  # the colocated schedule collects each step
    sampler.wrap(driver, "logprob_pass", "logprob")
    sampler.wrap(driver, "optimizer_step", "update")
    sampler.wrap(session, "_rollout_engine", "rollout copy")
    sampler.wrap(Policy, "build", "policy build")
    driver.run(recipe, overrides)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    peaks = {k: round(v - baseline, 1) for k, v in sampler.peaks.items()}
    marks = {k: [round(v - baseline, 1) for v in vs] for k, vs in sampler.marks.items()}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(
            {
                "baseline_mib": round(baseline, 1),
                "peak_mib": max(peaks.values()),
                "phases": peaks,
                "after": marks,
            },
            f,
        )


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(args[0], args[1], args[2:])
