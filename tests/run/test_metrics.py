"""Metrics sinks: metrics.jsonl, console, TensorBoard, Weights & Biases."""

import json
import sys
import types

import pytest

from grpo_ds.config.recipe import LoggingConfig
from grpo_ds.errors import UserError
from grpo_ds.run.metrics import MetricsLogger, check_logging_extras


def _steps(logger, n=3):
    for step in range(1, n + 1):
        logger.log(
            {
                "step": step,
                "reward_mean": step / 10,
                "loss": -step / 100,
                "note": "text is not a scalar",
            }
        )
    logger.close()


def test_jsonl_and_console(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, 5, LoggingConfig(every_steps=3, progress_bar=False))
    _steps(logger, 5)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5] and lines[2][
        "reward_mean"
    ] == pytest.approx(0.3)
    printed = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["1", "3", "5"]  # the first, every 3rd, and the last
    assert logger.history == lines


def test_rank_without_run_folder_writes_nothing(tmp_path):
    logger = MetricsLogger(None, 3, LoggingConfig(progress_bar=False, tensorboard=True))
    _steps(logger)
    assert len(logger.history) == 3 and not list(tmp_path.iterdir())


def test_tensorboard_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _steps(MetricsLogger(tmp_path, 3, LoggingConfig(progress_bar=False, tensorboard=True)))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"reward_mean", "loss"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("reward_mean")] == pytest.approx([0.1, 0.2, 0.3])


def test_wandb_gets_every_step(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(
        log=lambda data, step: calls.append(("log", step, data)),
        finish=lambda: calls.append(("finish",)),
    )
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LoggingConfig(progress_bar=False, wandb_project="grpo", wandb_mode="offline")
    _steps(MetricsLogger(tmp_path, 3, cfg, run_name="r1", config={"train": {"lr": 1.0}}))
    assert calls[0] == (
        "init",
        {
            "project": "grpo",
            "name": "r1",
            "dir": str(tmp_path),
            "mode": "offline",
            "config": {"train": {"lr": 1.0}},
        },
    )
    assert [c[1] for c in calls if c[0] == "log"] == [1, 2, 3]
    assert "note" not in calls[1][2] and calls[1][2]["loss"] == pytest.approx(-0.01)
    assert calls[-1] == ("finish",)


def test_missing_logging_package_is_a_user_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name)
    )
    with pytest.raises(UserError) as err:
        check_logging_extras(LoggingConfig(wandb_project="p"))
    assert err.value.where == "logging.wandb_project" and "[wandb]" in err.value.fix
    # off: no package needed
    check_logging_extras(LoggingConfig(wandb_project="p", wandb_mode="disabled"))


def test_wandb_without_credentials_logs_offline(tmp_path, monkeypatch, capsys):
    from grpo_ds.run.metrics import wandb_mode

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    assert wandb_mode("online") == "offline"
    assert "logging offline" in capsys.readouterr().err
    assert wandb_mode("disabled") == "disabled"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("online") == "online"
    monkeypatch.delenv("WANDB_API_KEY")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode("online") == "online"


def test_progress_bar_shows_eta_and_reward_and_resumes_where_it_stopped(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # a terminal
    logger = MetricsLogger(tmp_path, 10, LoggingConfig(progress_bar=True, every_steps=100))
    # after a checkpoint
    logger.resume([{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2}])
    logger.log({"step": 3, "reward_mean": 0.25, "loss": -0.5})
    assert logger.bar.n == 3 and logger.bar.total == 10
    logger.bar.refresh()
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "3/10" in last and "reward=0.250" in last and "loss=-0.5" in last
    assert "<" in last  # elapsed<remaining: the ETA
    logger.close()


def test_a_log_file_gets_step_lines_and_no_bar(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)  # nohup, SLURM, `> log`
    logger = MetricsLogger(tmp_path, 10, LoggingConfig(progress_bar=True, every_steps=5))
    assert logger.bar is None
    _steps(logger, 10)
    captured = capsys.readouterr()
    assert captured.err == "" and [line.split()[1] for line in captured.out.splitlines()] == [
        "1",
        "5",
        "10",
    ]


def test_samples_go_to_samples_jsonl(tmp_path):
    logger = MetricsLogger(tmp_path, 3, LoggingConfig(progress_bar=False))
    logger.samples(2, [{"prompt": "1+1=", "completion": "2", "reward": 1.0}])
    assert json.loads((tmp_path / "samples.jsonl").read_text()) == {
        "step": 2,
        "samples": [{"prompt": "1+1=", "completion": "2", "reward": 1.0}],
    }
