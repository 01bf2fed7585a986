"""The Weights & Biases sink against the real wandb package (the test extra installs it), offline: a
short tiny run with logging.wandb_project set, then its offline run read back from the .wandb file.
Nothing touches the network, the home folder or any credentials."""

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tests.launch import REPO, clean_env

wandb = pytest.importorskip("wandb", reason="the test extra installs wandb")

STEPS = 3
BLOCK = 32 * 1024  # the LevelDB log format's block size
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)  # ident, magic, version


def read_records(path: Path) -> list:
    """Every record of an offline run's ``run-<id>.wandb`` file, parsed with wandb's own protobuf
    classes.

    The file is W&B's transaction log in the LevelDB log format (older wandb read it in
    wandb/sdk/internal/datastore.py; wandb 0.31 has no Python reader, only its Go core): a 7-byte
    header, 32 KiB blocks of chunks, each a 7-byte header (CRC-32 of type and data, data length as
    2 bytes little-endian, type: 1 full, 2 first, 3 middle, 4 last) and its data; a block's last <
    7 bytes are padding."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[: len(HEADER)] == HEADER, f"{path} is not a W&B transaction log"
    records, pending, pos = [], b"", len(HEADER)
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding at a block's end
            continue
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), (
            f"bad checksum at byte {pos} of {path}"
        )
        pending += chunk
        if kind in (1, 4):  # a record ends here
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(records: list) -> dict[int, dict]:
    """step -> the metrics logged at it (wandb's own _step/_runtime/_timestamp left out)."""
    out = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            assert record.history.step.num not in out, (
                f"step {record.history.step.num} logged twice"
            )
            out[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def offline_env(tmp_path: Path) -> dict:
    """The test's environment with every W&B setting pointed into tmp_path: offline, no key, no home
    folder (the compiled DeepSpeed extensions stay where they are: a fresh cache would rebuild
    them)."""
    from torch.utils.cpp_extension import get_default_build_root

    env = {k: v for k, v in clean_env().items() if not k.startswith("WANDB_")}
    env.setdefault("TORCH_EXTENSIONS_DIR", get_default_build_root())
    home = tmp_path / "home"
    home.mkdir()
    env.update(
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp_path / "wandb_dir"),
        WANDB_SILENT="true",
        WANDB_DISABLE_CODE="true",
        WANDB_DISABLE_GIT="true",
        WANDB_ERROR_REPORTING="false",
        WANDB_CACHE_DIR=str(home / "cache"),
        WANDB_CONFIG_DIR=str(home / "config"),
        WANDB_DATA_DIR=str(home / "data"),
        HOME=str(home),
        NETRC=str(home / "no_netrc"),
        XDG_CACHE_HOME=str(home / "xdg_cache"),
        XDG_CONFIG_HOME=str(home / "xdg_config"),
    )
    return env


@pytest.mark.slow
# wandb starts a service process: a hang must fail the test, not stall the suite
@pytest.mark.timeout(300)
def test_an_offline_run_holds_every_steps_metrics(tmp_path):
    runs = tmp_path / "runs"
    cmd = [
        sys.executable,
        "-m",
        "grpo_ds.train",
        str(REPO / "recipes" / "tiny_cpu.json"),
        f"run.output_dir={runs}",
        "run.name=wb",
        f"train.steps={STEPS}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "train.micro_batch_samples_per_gpu=16",
        "logging.progress_bar=false",
        "logging.wandb_project=grpo_ds_test",
        "logging.wandb_mode=offline",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = runs / "wb"
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, STEPS + 1))

    # in the run folder, not in WANDB_DIR
    [offline] = list((run_dir / "wandb").glob("offline-run-*"))
    [log_file] = list(offline.glob("run-*.wandb"))
    records = read_records(log_file)
    got = history(records)
    assert sorted(got) == list(range(1, STEPS + 1))
    for metrics in logged:
        want = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        # reward, loss, kl, entropy, grad_norm, timings, ...: the step's real metrics
        assert len(want) >= 10
        assert got[metrics["step"]] == pytest.approx(want, rel=1e-12, nan_ok=True), metrics["step"]

    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert run.project == "grpo_ds_test" and run.display_name == "wb"
    # the recipe is the config
    assert config["train"]["steps"] == STEPS and config["rollout"]["group_size"] == 4
    # finished
    assert any(r.WhichOneof("record_type") == "exit" and r.exit.exit_code == 0 for r in records)


@pytest.mark.timeout(120)
def test_a_run_wandb_cannot_start_is_one_line(tmp_path):
    """Online mode with a key but no server (a compute node without network): the real wandb.init
    gives up after WANDB_INIT_TIMEOUT and the sink says so in one line, naming the offline mode."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **offline_env(tmp_path),
        "WANDB_MODE": "online",
        "WANDB_API_KEY": "0" * 40,
        "WANDB_BASE_URL": f"http://127.0.0.1:{port}",
        "WANDB_INIT_TIMEOUT": "5",
    }
    script = (
        "import sys; from pathlib import Path; from grpo_ds.errors import exit_on_user_error; "
        "from grpo_ds.run.metrics import MetricsLogger; from grpo_ds.config.recipe import "
        "LoggingConfig\n"
        "with exit_on_user_error():\n"
        "    MetricsLogger(Path(sys.argv[1]), 3, "
        "LoggingConfig(progress_bar=False, wandb_project='p'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(
        "error: logging.wandb_project: Weights & Biases could not start the run ("
    )
    assert 'set logging.wandb_mode to "offline"' in line
