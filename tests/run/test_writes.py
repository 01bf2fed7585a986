"""Write failures (grpo_ds.run.writes), by fault injection (tests/scripts/write_fault.py): a write
that fails as a full disk, a read-only file system or an exceeded quota would, at each point of a
checkpoint write, in the run files and in an export, is one error line naming the file, the cause
and the last good checkpoint (exit code 2 from the command line, no traceback, on every rank); the
unfinished folder is gone, the previous checkpoint verifies and the same command resumes from it. A
checkpoint or an export larger than the free space is refused before anything is written."""

import errno
import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

import grpo_ds
from grpo_ds import export
from grpo_ds.errors import UserError
from grpo_ds.run import checkpoint, writes
from tests.launch import REPO, clean_env, free_port, launch_command, remove_shm_buffers
from tests.scripts.write_fault import Fault, install

pytestmark = pytest.mark.slow

TINY = str(REPO / "recipes" / "tiny_cpu.json")
# Four small steps, checkpoints after steps 2 and 4: the faults hit the step-4 checkpoint, step 2's
# is the good one.
OVERRIDES = {
    "train.steps": 4,
    "checkpoint.every_steps": 2,
    "checkpoint.keep": 2,
    "rollout.prompts_per_step": 4,
    "rollout.group_size": 4,
    "train.micro_batch_samples_per_gpu": 4,
    "logging.progress_bar": False,
}
CLI_OVERRIDES = [f"{key}={json.dumps(value)}" for key, value in OVERRIDES.items()]
STEP4 = ".tmp-step_00000004"
# Wall-clock and memory figures differ between attempts; everything else must be identical.
VOLATILE = ("time_", "tokens_per_s", "generated_tokens_per_s", "peak_memory_gib")


def _overrides(out: Path) -> dict:
    return {"run.output_dir": str(out), **OVERRIDES}


def _message(where: str, path: Path, code: int, last_good: Path | None) -> str:
    cause = f"{os.strerror(code)} ({errno.errorcode[code]})"
    remedy = writes.remedy(OSError(code, ""))
    fix = (
        f"the last good checkpoint is {last_good}; {remedy} "
        "and run the same command to resume from it"
        if last_good
        else f"the run has no checkpoint yet; {remedy} and run the same command to start it again"
    )
    return f"{where}: cannot write {path}: {cause}. {fix}."


def _logged(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records}


def _assert_left_as_before(run_dir: Path, good: str = "step_00000002") -> None:
    """Only the good checkpoint is left, ``latest`` names it and it verifies; no probe file is left
    anywhere."""
    ckpts = run_dir / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["latest", good]
    assert checkpoint.latest_name(run_dir) == good
    assert checkpoint.verify(ckpts / good) is None
    assert not [p for p in run_dir.rglob("*") if p.name.startswith(".grpo_ds-write-probe")]


def _resume_and_compare(run_dir: Path, out: Path, capfd) -> None:
    """The same command again resumes after step 2 and logs the steps the failed attempt logged."""
    before = _logged(run_dir)
    capfd.readouterr()
    history = grpo_ds.train(TINY, _overrides(out))
    assert (
        f"resuming after step 2 from {run_dir / 'checkpoints' / 'step_00000002'}"
        in capfd.readouterr().err
    )
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    after = _logged(run_dir)
    assert sorted(after) == [1, 2, 3, 4]
    assert all(after[s] == before[s] for s in before), (
        "the resumed steps differ from the failed attempt's"
    )
    assert checkpoint.verify(run_dir / "checkpoints" / "step_00000004") is None


# the injected fault, the file the message names (under checkpoints/)
Point = namedtuple("Point", "fault file")
CHECKPOINT_POINTS = {
    # DeepSpeed's shards; torch's zip writer hides the cause (a RuntimeError), found by
    # grpo_ds.run.writes's probe write
    "optimizer_shard_hidden_enospc": Point(
        Fault(
            "torch.save",
            f"{STEP4}/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            errno.ENOSPC,
            hidden=True,
        ),
        f"{STEP4}/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ),
    # one rank: stage 1
    "model_shard_quota": Point(
        Fault("torch.save", f"{STEP4}/ds/mp_rank_00_model_states.pt", errno.EDQUOT),
        f"{STEP4}/ds/mp_rank_00_model_states.pt",
    ),
    "deepspeed_recovery_script": Point(
        Fault("deepspeed.copyfile", f"{STEP4}/zero_to_fp32.py"), f"{STEP4}/zero_to_fp32.py"
    ),
    "deepspeed_tag_file": Point(Fault("deepspeed.open", f"{STEP4}/latest"), f"{STEP4}/latest"),
    "rng_states": Point(Fault("torch.save", f"{STEP4}/rng/rank0.pt"), f"{STEP4}/rng/rank0.pt"),
    "trainer_state": Point(
        Fault("write_text", f"{STEP4}/trainer_state.json"), f"{STEP4}/trainer_state.json"
    ),
    "manifest_read_only": Point(
        Fault("write_text", f"{STEP4}/manifest.json", errno.EROFS), f"{STEP4}/manifest.json"
    ),
    "rename_read_only": Point(Fault("os.rename", STEP4, errno.EROFS), STEP4),
    # after the rename: the new folder is complete but `latest` cannot name it, so it is removed
    # again
    "latest_pointer": Point(Fault("write_text", "checkpoints/latest.tmp", nth=2), "latest.tmp"),
    "folder_read_only": Point(Fault("mkdir", STEP4, errno.EROFS), STEP4),
}


@pytest.mark.parametrize("name", list(CHECKPOINT_POINTS))
def test_a_failed_checkpoint_write_is_one_error_and_the_same_command_resumes(
    tmp_path, monkeypatch, capfd, name
):
    point = CHECKPOINT_POINTS[name]
    run_dir = tmp_path / "tiny_cpu"
    ckpts = run_dir / "checkpoints"
    with monkeypatch.context() as patch:
        fault = install(point.fault, patch.setattr)
        with pytest.raises(UserError) as raised:
            grpo_ds.train(TINY, _overrides(tmp_path))
    assert fault.fired
    assert str(raised.value) == _message(
        "checkpoint step 4", ckpts / point.file, point.fault.code, ckpts / "step_00000002"
    )
    _assert_left_as_before(run_dir)
    _resume_and_compare(run_dir, tmp_path, capfd)


@pytest.mark.parametrize("log", ["metrics.jsonl", "ranks/rank0.jsonl"])
def test_a_failed_run_file_write_stops_the_run_with_one_error(tmp_path, monkeypatch, capfd, log):
    run_dir = tmp_path / "tiny_cpu"
    with monkeypatch.context() as patch:
        install(Fault("append", log, errno.ENOSPC, nth=3), patch.setattr)  # step 3's record
        with pytest.raises(UserError) as raised:
            grpo_ds.train(TINY, _overrides(tmp_path))
    assert str(raised.value) == _message(
        "step 3", run_dir / log, errno.ENOSPC, run_dir / "checkpoints" / "step_00000002"
    )
    _assert_left_as_before(run_dir)
    _resume_and_compare(run_dir, tmp_path, capfd)


def test_a_failed_write_at_the_end_of_the_run_is_one_error_and_the_same_command_finishes(
    tmp_path, monkeypatch, capfd
):
    run_dir = tmp_path / "tiny_cpu"
    with monkeypatch.context() as patch:
        install(Fault("write_text", "tiny_cpu/complete.json.tmp", errno.ENOSPC), patch.setattr)
        with pytest.raises(UserError) as raised:
            grpo_ds.train(TINY, _overrides(tmp_path))
    assert str(raised.value) == _message(
        "end of the run",
        run_dir / "complete.json.tmp",
        errno.ENOSPC,
        run_dir / "checkpoints" / "step_00000004",
    )
    assert not (run_dir / "complete.json").exists()
    capfd.readouterr()
    assert [m["step"] for m in grpo_ds.train(TINY, _overrides(tmp_path))] == [1, 2, 3, 4]
    assert "resuming after step 4" in capfd.readouterr().err
    assert json.loads((run_dir / "complete.json").read_text())["steps"] == 4


def test_a_failed_final_model_write_leaves_no_partial_folder(tmp_path, monkeypatch, capfd):
    """final_model/ is written beside itself and renamed into place: a failed write leaves neither a
    partial final_model/ nor the temporary folder, and the same command writes it."""
    run_dir = tmp_path / "tiny_cpu"
    with monkeypatch.context() as patch:
        install(
            Fault("os.rename", f"tiny_cpu/.tmp-final_model-{os.getpid()}", errno.EROFS),
            patch.setattr,
        )
        with pytest.raises(UserError) as raised:
            grpo_ds.train(TINY, _overrides(tmp_path))
    assert str(raised.value).startswith("end of the run: cannot write ") and "(EROFS)" in str(
        raised.value
    )
    assert not (run_dir / "final_model").exists() and not list(run_dir.glob(".tmp-*"))
    capfd.readouterr()
    grpo_ds.train(TINY, _overrides(tmp_path))
    assert (run_dir / "final_model" / "config.json").is_file() and not list(run_dir.glob(".tmp-*"))


def test_a_failed_write_while_resuming_is_one_error_and_the_checkpoint_is_untouched(
    tmp_path, monkeypatch, capfd
):
    grpo_ds.train(TINY, _overrides(tmp_path))
    run_dir, longer = tmp_path / "tiny_cpu", {**_overrides(tmp_path), "train.steps": 6}
    with monkeypatch.context() as patch:
        # the trimmed log
        install(Fault("write_text", "tiny_cpu/metrics.jsonl.tmp", errno.ENOSPC), patch.setattr)
        with pytest.raises(UserError) as raised:
            grpo_ds.train(TINY, longer)
    assert str(raised.value) == (
        f"resume: cannot write {run_dir / 'metrics.jsonl.tmp'}: No space left on device "
        "(ENOSPC). the checkpoint is untouched: free space and run the same command again."
    )
    assert checkpoint.verify(run_dir / "checkpoints" / "step_00000004") is None
    capfd.readouterr()
    assert [m["step"] for m in grpo_ds.train(TINY, longer)] == [1, 2, 3, 4, 5, 6]
    assert "resuming after step 4" in capfd.readouterr().err


def test_a_run_folder_that_cannot_be_written_is_one_error(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        install(Fault("write_text", "tiny_cpu/recipe.json.tmp", errno.EROFS), patch.setattr)
        with pytest.raises(UserError) as raised:
            grpo_ds.train(TINY, _overrides(tmp_path))
    run_dir = tmp_path / "tiny_cpu"
    assert str(raised.value) == _message(
        "run folder", run_dir / "recipe.json.tmp", errno.EROFS, None
    )
    assert not (run_dir / "checkpoints").exists()


def test_a_checkpoint_larger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    """The first checkpoint's size is estimated from the trainable parameters; later ones are the
    previous one's."""
    run_dir, ckpts = tmp_path / "tiny_cpu", tmp_path / "tiny_cpu" / "checkpoints"
    real_usage = shutil.disk_usage
    free = {"bytes": 2**20}

    def usage(path):
        return real_usage(path)._replace(free=free["bytes"])

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "disk_usage", usage)
        with pytest.raises(UserError) as raised:
            grpo_ds.train(TINY, _overrides(tmp_path))
    message = str(raised.value)
    assert message.startswith(
        f"checkpoint step 2: not enough free space in {ckpts} for the checkpoint ("
    )
    # one rank runs ZeRO stage 1: fp32 master weights, Adam's two moments and the module's fp32
    # weights
    assert (
        "trainable parameters x 16 B, plus 5%): it needs about " in message
        and "1.0 MiB is free" in message
    )
    assert message.endswith(
        "the run has no checkpoint yet; free space and run the same command to start it again."
    )
    assert os.listdir(ckpts) == []
    parameters = int(message.split("checkpoint (")[1].split(" trainable")[0].replace(",", ""))

    shutil.rmtree(run_dir)
    free["bytes"] = 2**40
    with monkeypatch.context() as patch:
        patch.setattr(shutil, "disk_usage", usage)
        # full once step 2 is written
        patch.setattr(checkpoint, "_finish", _then_fill(checkpoint._finish, free))
        with pytest.raises(UserError) as raised:
            grpo_ds.train(TINY, _overrides(tmp_path))
    first = checkpoint._folder_bytes(ckpts / "step_00000002")
    assert str(raised.value) == (
        f"checkpoint step 4: not enough free space in {ckpts} for the checkpoint (the size of "
        f"step_00000002, plus 5%): it needs about {writes.gib(int(first * 1.05))}, "
        f"{writes.gib(first)} is free. the last good checkpoint is "
        f"{ckpts / 'step_00000002'}; free space and run the same command to resume from it."
    )
    _assert_left_as_before(run_dir)
    # the estimate for a first checkpoint is the real size within 10%
    assert abs(parameters * 16 - first) < 0.1 * first


def _then_fill(finish, free: dict):
    def wrapped(run_dir, tmp, final, *args):
        finish(run_dir, tmp, final, *args)
        free["bytes"] = checkpoint._folder_bytes(final)  # just less than the next one needs

    return wrapped


# --------------------------------------------------------------------------------- the command line


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    return errors[0]


def test_the_command_line_gives_one_line_and_exit_code_2_then_resumes(tmp_path):
    args = [TINY, f"run.output_dir={tmp_path}", *CLI_OVERRIDES]
    env = {**clean_env(), "GRPO_DS_WRITE_FAULT": f"torch.save:{STEP4}/rng/rank0.pt:ENOSPC"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripts.write_fault", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    ckpts = tmp_path / "tiny_cpu" / "checkpoints"
    assert _one_error_line(proc) == "error: " + _message(
        "checkpoint step 4",
        ckpts / STEP4 / "rng" / "rank0.pt",
        errno.ENOSPC,
        ckpts / "step_00000002",
    )
    _assert_left_as_before(tmp_path / "tiny_cpu")
    again = subprocess.run(
        [sys.executable, "-m", "grpo_ds.train", *args],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resuming after step 2 from {ckpts / 'step_00000002'}" in again.stderr
    assert checkpoint.latest_name(tmp_path / "tiny_cpu") == "step_00000004"


def test_a_failure_on_one_rank_stops_both_ranks_with_one_line(tmp_path):
    """Rank 1's optimizer shard cannot be written; rank 0's writes succeed. Neither rank may wait
    for the other."""
    port = free_port()
    env = {
        **clean_env(),
        "GRPO_DS_WRITE_FAULT": f"torch.save:{STEP4}/ds/zero_pp_rank_1_mp_rank_00_optim_states.pt:"
        "ENOSPC",
    }
    try:
        command = launch_command(
            2,
            [
                "--module",
                "tests.scripts.write_fault",
                TINY,
                f"run.output_dir={tmp_path}",
                *CLI_OVERRIDES,
            ],
            port,
        )
        proc = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
    finally:
        remove_shm_buffers(port)
    ckpts = tmp_path / "tiny_cpu" / "checkpoints"
    output = subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout, proc.stdout + proc.stderr
    )
    assert _one_error_line(output) == "error: " + _message(
        "checkpoint step 4",
        ckpts / STEP4 / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        errno.ENOSPC,
        ckpts / "step_00000002",
    )
    _assert_left_as_before(tmp_path / "tiny_cpu")


# ------------------------------------------------------------------------------------------ exports


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export_run")
    grpo_ds.train(TINY, {**_overrides(out), "train.steps": 2})
    return out / "tiny_cpu"


def _safetensors_full_disk(*args, **kwargs):
    raise RuntimeError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
        'left on device" })'
    )  # safetensors' own error type names no errno either


@pytest.mark.parametrize("point", ["weights_hidden_enospc", "rename_read_only"])
def test_a_failed_export_write_leaves_nothing_and_is_one_line(
    trained, tmp_path, monkeypatch, capsys, point
):
    out = tmp_path / "exported"
    with monkeypatch.context() as patch:
        if point == "weights_hidden_enospc":
            import transformers.modeling_utils

            fault = install(Fault("torch.save", "never", errno.ENOSPC, hidden=True), patch.setattr)
            fault.fired = True  # the disk is full from the start: the probe write fails too
            patch.setattr(transformers.modeling_utils, "safe_save_file", _safetensors_full_disk)
            code = errno.ENOSPC
        else:
            install(Fault("os.rename", "", errno.EROFS), patch.setattr)
            code = errno.EROFS
        with pytest.raises(SystemExit) as exited:
            export.main([str(trained), "--out", str(out)])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0]
    # the folder renamed into place once complete
    written = tmp_path / f".tmp-exported-{os.getpid()}"
    assert lines[0] == (
        f"error: export: cannot write {written}: {os.strerror(code)} ({errno.errorcode[code]}). "
        f"nothing was written to {out}; "
        f"{writes.remedy(OSError(code, ''))} and run the export again."
    )
    assert os.listdir(tmp_path) == []  # neither the output folder nor the temporary one
    export.main([str(trained), "--out", str(out)])  # the disk fixed, the same command works
    assert (out / "model.safetensors").is_file()


def test_an_export_larger_than_the_free_space_is_refused(trained, tmp_path, monkeypatch):
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=2**20))
    with pytest.raises(
        UserError,
        match=r"^export: not enough free space in .* for the model \(.* of weights\): "
        r"it needs about .*, 1\.0 MiB is free\. free space and run the export again",
    ):
        export.export(trained, tmp_path / "exported")
    assert os.listdir(tmp_path) == []
