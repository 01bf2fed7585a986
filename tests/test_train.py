"""The driver end to end: pinned first-step numbers, the tiny recipe learning, several ranks."""

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import grpo_ds
import grpo_ds.session as session_module
from tests.launch import (
    REPO,
    clean_env,
    deepspeed_launch,
    free_port,
    launch_command,
    remove_shm_buffers,
)
from tests.shared_runs import tiny_recipe_run

TINY = str(REPO / "recipes" / "tiny_cpu.json")

REWARDS_MODULE = '''
def first_char(completions, **kwargs):
    """A dense, deterministic reward so advantages are non-zero from the first step."""
    return [(ord(c[0]) % 7) / 7 if c else 0.0 for c in completions]


def broken(completions, **kwargs):
    raise ValueError("this reward function is broken")


def exits(completions, **kwargs):
    import os
    os._exit(3)  # as a C extension that calls exit() would: the whole process ends


def logged(prompts, completions, **kwargs):
    """exact_match's score, and one line per scored sample appended to $SCORED_LOG (any worker may write)."""
    import os
    with open(os.environ["SCORED_LOG"], "a") as log:
        log.write("".join(f"{p!r} {c!r}\\n" for p, c in zip(prompts, completions)))
    return [float(c.strip() == str(a)) for c, a in zip(completions, kwargs["answer"])]
'''  # noqa: E501


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "pin_rewards.py").write_text(REWARDS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "pin_rewards"


def _small(tmp_path, **overrides):
    base = {
        "run.output_dir": str(tmp_path / "runs"),
        "train.steps": 3,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "train.micro_batch_samples_per_gpu": 4,
        "logging.progress_bar": False,
    }
    base.update(overrides)
    return base


# Pinned from a run of this commit's math (CPU, fp32). Two optimizer steps per rollout (so the PPO
# ratio moves and clips), a k3 KL term and an entropy bonus: every term of the loss contributes. A
# refactor that changes any of them changes these numbers. Tolerance: float32 reductions in another
# order (~1e-6). Re-pinned when the hf engine began to draw its own samples
# (grpo_ds.rollout.hf.TokenSampler: other random numbers, so other completions), and again when each
# sample got its own stream keyed by its place in the step
# (grpo_ds.rollout.streams: the same samples at any world size); the loss math was unchanged both
# times, and every kernel path gave these values again.
PINNED = [
    {
        "reward_mean": 0.40178571428571425,
        "loss": -0.06275864690542221,
        "kl": 0.005838122218847275,
        "entropy": 4.624950289726257,
        "clip_frac": 0.0625,
        "grad_norm": 2.009141445159912,
    },
    {
        "reward_mean": 0.38392857142857145,
        "loss": -0.07813819125294685,
        "kl": 0.02043570626166559,
        "entropy": 4.612757159817603,
        "clip_frac": 0.0967741935483871,
        "grad_norm": 1.5041068494319916,
    },
    {
        "reward_mean": 0.5624999999999999,
        "loss": -0.05126854032278061,
        "kl": 0.030396729707717896,
        "entropy": 4.590234994888306,
        "clip_frac": 0.0,
        "grad_norm": 1.3892328143119812,
    },
]


# Pinned before grpo_ds.kernels existed (full logits, the reference in grpo_ds/algo); every kernel
# path must reproduce them. The Triton backend runs through Triton's interpreter on CPU
# (tests/conftest.py).
KERNEL_PATHS = [
    ("torch", True),
    ("torch", False),
    pytest.param(
        "triton",
        True,
        marks=pytest.mark.skipif(
            importlib.util.find_spec("triton") is None, reason="triton is not installed"
        ),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "fused_lm_head"), KERNEL_PATHS)
def test_first_steps_are_pinned(tmp_path, reward_module, backend, fused_lm_head):
    metrics = grpo_ds.train(
        TINY,
        _small(
            tmp_path,
            **{
                "reward.functions": [{"name": f"{reward_module}:first_char"}],
                "train.samples_per_optimizer_step": 8,
                "algorithm.kl_coef": 0.1,
                "algorithm.entropy_coef": 0.01,
                "train.lr": 0.01,
                "kernels.backend": backend,
                "kernels.fused_lm_head": fused_lm_head,
                "rollout.temperature": 1.3,
            },
        ),
    )
    assert len(metrics) == 3
    for got, want in zip(metrics, PINNED, strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (got["step"], key)


@pytest.mark.slow
# its run is shared (tests/shared_runs.py): one worker makes it once
@pytest.mark.xdist_group("tiny_recipe_run")
def test_tiny_recipe_learns_from_the_command_line():
    """The README's run: reward rises from ~0 to >= 0.9 (mean of the last 10 steps), on console and
    on disk. The run is shared with the docs' transcript test (tests/shared_runs.py):
    `python -m grpo_ds.train recipes/tiny_cpu.json` from a folder holding recipes/ and ds_configs/,
    stdout and stderr read interleaved, as a terminal shows them."""
    run = tiny_recipe_run()
    output, run_dir = run.output, run.cwd / "runs" / "tiny_cpu"
    assert run.returncode == 0, output[-4000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 261))
    first = sum(m["reward_mean"] for m in lines[:10]) / 10
    last = sum(m["reward_mean"] for m in lines[-10:]) / 10
    assert first < 0.1
    assert last >= 0.9, f"reward of the last 10 steps {last:.3f}"
    assert "step  260 reward_mean=" in output  # the console line of the last step
    # a log, not a terminal: the periodic step lines and no progress-bar frames (`> log 2>&1` stays
    # small)
    assert "%|" not in output and "\r" not in output
    assert len(output.encode()) < 20_000
    written = json.loads((run_dir / "recipe.json").read_text())
    assert written["rollout"]["group_size"] == 32
    ds = json.loads((run_dir / "deepspeed.json").read_text())
    # one rank: stage 1
    assert ds["train_batch_size"] == 800 and ds["zero_optimization"]["stage"] == 1
    assert "ZeRO stage 3 runs as stage 1 on one rank" in output


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "steps"), [("dapo_tiny_cpu", 180), ("multiturn_tiny_cpu", 170)])
def test_algorithm_recipes_learn_from_the_command_line(tmp_path, recipe, steps):
    """The DAPO and multi-turn recipes (docs/guides/recipes.md): reward rises from ~0 to >= 0.5
    (mean of the last 10 steps), in their first ``steps`` steps (of 300 and 250; a constant learning
    rate, so the same steps as the whole run's). Measured with seeds 0, 1, 2 on 2026-11-27, last-10
    means: DAPO at 180 steps 0.68, 0.82, 0.86 (0.91, 0.98, 0.92 at 300); multi-turn at 170 steps
    0.79, 0.81, 0.77 (1.04, 1.00, 1.01 at 250)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_ds.train",
            str(REPO / "recipes" / f"{recipe}.json"),
            f"run.output_dir={tmp_path}",
            "logging.progress_bar=false",
            f"train.steps={steps}",
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [
        json.loads(line) for line in (tmp_path / recipe / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    first = sum(m["reward_mean"] for m in lines[:10]) / 10
    last = sum(m["reward_mean"] for m in lines[-10:]) / 10
    assert first < 0.1 and last >= 0.5, (
        f"reward of the first / last 10 steps {first:.3f} / {last:.3f}"
    )
    # dynamic sampling drew extra rounds and the overlong penalty was applied
    if recipe == "dapo_tiny_cpu":
        assert any(m["dynamic/rounds"] > 1 for m in lines)
        assert all("reward/overlong_penalty" in m for m in lines)
    else:  # the environment scored every episode
        assert all("reward/env" in m for m in lines)


@pytest.mark.slow
def test_tiny_recipe_learns_over_a_truncated_set(tmp_path):
    """The tiny recipe sampling top_p 0.9 (grpo_ds.algo.truncation: the trainer replays the set)
    with importance weights: the weights are 1 (staleness 0, float32), and the reward rises from ~0
    to >= 0.9 (mean of the last 10 steps), as without truncation. (A narrow set can leave every
    correct completion of the random tiny model outside it, where no sample reaches it:
    docs/concepts/truncated-sampling.md measures top_k 8.)

    The tiny model's rows are nearly flat, ~90 tokens of ~0.01 each in the set, so the mass above
    the token at the cut is p to within the float32 rounding of its sum at some positions of some
    steps: there the sampler's set and the trainer's differ by that one token, and its weights by
    that token's probability (measured: 1 step of 260 off 1 by more than 1e-5 in the mean, 4.4e-5;
    the smallest weight of the run 0.994). Every step is held to 1e-4 in the mean and 0.98 at the
    smallest, and all but 2% of them to 1e-5."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_ds.train",
            TINY,
            f"run.output_dir={tmp_path}",
            "logging.progress_bar=false",
            "rollout.top_p=0.9",
            "algorithm.rollout_is_cap=2",
        ],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [
        json.loads(line)
        for line in (tmp_path / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(lines) == 260 and all(
        abs(m["is_weight_mean"] - 1) <= 1e-4 and m["is_weight_min"] >= 0.98 for m in lines
    )
    assert sum(abs(m["is_weight_mean"] - 1) > 1e-5 for m in lines) <= 0.02 * len(lines)
    first = sum(m["reward_mean"] for m in lines[:10]) / 10
    last = sum(m["reward_mean"] for m in lines[-10:]) / 10
    assert first < 0.1 and last >= 0.9, (
        f"reward of the first / last 10 steps {first:.3f} / {last:.3f}"
    )


@pytest.mark.slow
def test_a_broken_reward_function_is_contained(tmp_path, reward_module):
    metrics = grpo_ds.train(
        TINY,
        _small(
            tmp_path,
            **{
                "train.steps": 2,
                "reward.functions": [
                    {"name": "exact_match", "weight": 1.0},
                    {"name": f"{reward_module}:broken", "weight": 1.0},
                ],
            },
        ),
    )
    assert len(metrics) == 2  # the run went on
    # every sample counted
    assert all(m[f"reward_errors/{reward_module}:broken"] == 16 for m in metrics)


@pytest.mark.slow
def test_existing_run_folder_is_not_overwritten(tmp_path):
    # (checkpoint.resume "auto", the default, continues the same recipe's run instead:
    # tests/test_resume.py)
    grpo_ds.train(TINY, _small(tmp_path, **{"train.steps": 1, "run.overwrite": False}))
    from grpo_ds.errors import UserError

    with pytest.raises(UserError) as err:
        grpo_ds.train(
            TINY,
            _small(
                tmp_path, **{"train.steps": 1, "run.overwrite": False, "checkpoint.resume": "never"}
            ),
        )
    assert err.value.where == "run.name" and "already holds a run" in err.value.what


def test_generating_with_the_policy_module_equals_a_synced_copy(tmp_path, monkeypatch):
    """One rank trains with ZeRO stage 1, where the hf engine generates with the policy's own
    module: the same rollouts, metrics and final weights as with an unsharded copy synced after
    every step."""
    shared = grpo_ds.train(TINY, _small(tmp_path, **{"run.name": "shared"}))
    built = []
    real = session_module._rollout_engine
    monkeypatch.setattr(
        session_module,
        "_rollout_engine",
        lambda *a, **kw: built.append(real(*a, **kw)) or built[-1],
    )
    monkeypatch.setattr(session_module, "rollout_shares_policy", lambda *_: False)
    copied = grpo_ds.train(TINY, _small(tmp_path, **{"run.name": "copied"}))
    assert not built[0].shares_policy_weights  # the second run generated with a copy

    def numbers(metrics):  # everything but timings and memory
        return {
            k: v
            for k, v in metrics.items()
            if not k.startswith("time_") and "per_s" not in k and k != "peak_memory_gib"
        }

    assert [numbers(m) for m in shared] == [numbers(m) for m in copied]
    logs = {name: _rank_logs(tmp_path / "runs" / name, 1)[0][-1] for name in ("shared", "copied")}
    assert logs["shared"]["final_weights_sha256"] == logs["copied"]["final_weights_sha256"]
    # no copy to compare: the shared run had none
    assert "rollout_weights_sha256" not in logs["shared"]
    assert logs["copied"]["rollout_weights_sha256"] == logs["copied"]["final_weights_sha256"]


def _rank_logs(run_dir, world):
    logs = []
    for rank in range(world):
        records = [
            json.loads(line)
            for line in (run_dir / "ranks" / f"rank{rank}.jsonl").read_text().splitlines()
        ]
        logs.append(records)
    return logs


# the tiny model as a mixture of experts (grpo_ds.model.tiny) with its routers' load-balancing loss
MOE = ["model.tiny_num_experts=8", "model.router_aux_loss_coef=0.01"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, prompts, group, micro, model",
    [(2, 3, 3, 2, []), (3, 5, 4, 3, []), (2, 3, 3, 2, MOE)],
    ids=["2", "3", "2-moe"],
)
def test_ranks_train_different_samples_and_end_identical_even_when_counts_do_not_divide(
    tmp_path, world, prompts, group, micro, model
):
    """Each rank trains its own samples of a step, together every sample once, and all end with the
    same weights and rollout copies; sample counts that do not divide the world size (9 on 2 ranks,
    20 on 3) are padded, not refused. (One launch per world size: the 2-rank case was also a
    separate launch of the whole tiny recipe's 800 samples.) The same for the tiny mixture of
    experts on 2 ranks under ZeRO-3, whose fused expert tensors reach the rollout copies whole, with
    its router metric logged."""
    deepspeed_launch(
        world,
        [
            "--module",
            "grpo_ds.train",
            TINY,
            f"run.output_dir={tmp_path}",
            "train.steps=2",
            f"rollout.prompts_per_step={prompts}",
            f"rollout.group_size={group}",
            f"train.micro_batch_samples_per_gpu={micro}",
            "logging.progress_bar=false",
            *model,
        ],
    )
    metrics = [
        json.loads(line)
        for line in (tmp_path / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(metrics) == 2
    assert all(("router_aux_loss" in m) == bool(model) for m in metrics)
    # uneven shards were padded, not refused
    assert all(m["padding_micro_batches"] >= 1 for m in metrics)
    logs = _rank_logs(tmp_path / "tiny_cpu", world)
    for step in range(2):
        shards = [set(logs[r][step]["trained_sample_ids"]) for r in range(world)]
        # different samples of the step
        assert all(shards) and sum(map(len, shards)) == len(set().union(*shards))
        trained = [s for r in range(world) for s in logs[r][step]["trained_sample_ids"]]
        # together: every sample of the step, once
        assert sorted(trained) == list(range(prompts * group))
    assert len({logs[r][-1]["final_weights_sha256"] for r in range(world)}) == 1
    # every rank's rollout copy holds exactly the policy's weights after the last sync
    assert all(log[-1]["rollout_weights_sha256"] == log[-1]["final_weights_sha256"] for log in logs)


@pytest.mark.slow
def test_a_failure_on_rank_0_stops_every_rank(tmp_path, reward_module):
    """reward.on_error=fail raises on rank 0 during the decision: one line naming the function, exit
    2, and rank 1 does not hang in a collective."""
    env = clean_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    # not the launcher's default 29500: another launch may be using it (a test beside this one)
    port = free_port()
    try:
        proc = subprocess.run(
            launch_command(
                2,
                [
                    "--module",
                    "grpo_ds.train",
                    TINY,
                    f"run.output_dir={tmp_path}",
                    "train.steps=2",
                    "reward.on_error=fail",
                    f'reward.functions=[{{"name": "{reward_module}:broken"}}]',
                ],
                port,
            ),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        remove_shm_buffers(port)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if "error: reward function" in line]
    assert (
        len(errors) == 1
        and "'pin_rewards:broken': raised ValueError: this reward function is broken" in errors[0]
    )


@pytest.mark.slow
def test_a_reward_that_ends_its_process_does_not_end_the_run(tmp_path, reward_module, caplog):
    """A reward function that calls os._exit runs in a reward worker: under "zero" its samples score
    0 and are counted, the other function scores, and the run trains to its last step."""
    metrics = grpo_ds.train(
        TINY,
        _small(
            tmp_path,
            **{
                "reward.functions": [{"name": "exact_match"}, {"name": f"{reward_module}:exits"}],
                "reward.chunk_samples": 4,
            },
        ),
    )
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m[f"reward_errors/{reward_module}:exits"] == 16 for m in metrics)
    assert all(m["reward_errors/exact_match"] == 0 for m in metrics)
    assert (
        f"reward function '{reward_module}:exits' ended its worker process (exited with code 3"
        in caplog.text
    )


@pytest.mark.slow
def test_a_resume_scores_no_sample_twice(tmp_path, reward_module, monkeypatch):
    """Rewards are scored once per step, before the step's checkpoint: a run stopped after step 2
    and resumed to step 4 scores exactly the samples of an uninterrupted 4-step run, each once."""

    def scored(name: str, *stops: int) -> list[str]:
        monkeypatch.setenv("SCORED_LOG", str(tmp_path / f"{name}.log"))
        for steps in stops:
            grpo_ds.train(
                TINY,
                _small(
                    tmp_path,
                    **{
                        "run.name": name,
                        "train.steps": steps,
                        "checkpoint.every_steps": 1,
                        "reward.chunk_samples": 4,
                        "reward.functions": [{"name": f"{reward_module}:logged"}],
                    },
                ),
            )
        return sorted((tmp_path / f"{name}.log").read_text().splitlines())

    resumed = scored("resumed", 2, 4)
    assert len(resumed) == 4 * 16 and resumed == scored("whole", 4)


@pytest.mark.slow
def test_final_model_is_a_local_hf_folder_to_train_from(tmp_path):
    grpo_ds.train(TINY, _small(tmp_path, **{"train.steps": 2, "run.name": "first"}))
    folder = tmp_path / "runs" / "first" / "final_model"
    from grpo_ds.config.recipe import ModelConfig
    from grpo_ds.model.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(path=str(folder)))
    assert tokenizer.decode(tokenizer.encode("3+4=")) == "3+4="
    from grpo_ds.model.policy import weights_sha256

    model = load_model(ModelConfig(path=str(folder)), len(tokenizer), seed=0)
    rank_log = (tmp_path / "runs" / "first" / "ranks" / "rank0.jsonl").read_text().splitlines()
    # trained
    assert json.loads(rank_log[-1])["final_weights_sha256"] == weights_sha256(
        model.named_parameters()
    )
    metrics = grpo_ds.train(
        TINY,
        _small(tmp_path, **{"train.steps": 1, "run.name": "second", "model.path": str(folder)}),
    )
    assert len(metrics) == 1


def _two_ranks_like_one(tmp_path, layout: str, overrides: list[str]):
    """The tiny recipe on one rank and, through the launcher, on 2 ranks with ``layout`` (dp = 1:
    the same samples): the metrics step by step, the rank logs' final weights; return the 2-rank
    run's folder."""
    single = grpo_ds.train(TINY, [f"run.output_dir={tmp_path / 'one'}", *overrides])
    deepspeed_launch(
        2,
        [
            "--module",
            "grpo_ds.train",
            TINY,
            f"run.output_dir={tmp_path / 'two'}",
            layout,
            *overrides,
        ],
    )
    run_dir = tmp_path / "two" / "tiny_cpu"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(single, metrics, strict=True):
        assert a["reward_mean"] == b["reward_mean"]  # the same rollouts: the weights stayed equal
        # the loss: summed once per tensor-parallel group
        for key in ("entropy", "grad_norm", "loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-9), key
    logs = _rank_logs(run_dir, 2)
    assert logs[0][-1]["final_weights_sha256"] == logs[1][-1]["final_weights_sha256"]
    assert all(log[-1]["rollout_weights_sha256"] == log[-1]["final_weights_sha256"] for log in logs)
    return run_dir


@pytest.mark.slow
def test_tensor_parallel_run_trains_like_one_rank_and_exports_a_full_model(tmp_path):
    """train.tensor_parallel_size=2 on 2 ranks: the same samples and metrics as one rank, both
    ranks' rollout copies equal the policy, and the export of its checkpoint (one set of files per
    tensor-parallel rank) is a full transformers folder with the single-rank run's weights."""
    run_dir = _two_ranks_like_one(
        tmp_path,
        "train.tensor_parallel_size=2",
        ["train.steps=3", "checkpoint.every_steps=3", "logging.progress_bar=false"],
    )
    # split checkpoint
    assert len(list((run_dir / "checkpoints" / "step_00000003" / "ds").glob("*mp_rank_01*"))) > 0
    subprocess.run(
        [sys.executable, "-m", "grpo_ds.export", str(run_dir), "--out", str(tmp_path / "export")],
        cwd=REPO,
        env=clean_env(),
        check=True,
        capture_output=True,
    )
    check = (
        "import sys, torch; from transformers import AutoModelForCausalLM as M; "
        "a, b = (dict(M.from_pretrained(p).named_parameters()) for p in sys.argv[1:]); "
        "assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a); "
        "print(max((a[k] - b[k]).abs().max().item() for k in a))"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            check,
            str(tmp_path / "export"),
            str(tmp_path / "one" / "tiny_cpu" / "final_model"),
        ],
        env=clean_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # transformers alone loads it: the one-rank run's weights
    assert float(out.strip().splitlines()[-1]) < 1e-5


@pytest.mark.slow
def test_sequence_parallel_run_trains_like_one_rank(tmp_path):
    """train.sequence_parallel_size=2 on 2 ranks (every sequence split in two): the same samples,
    metrics and final weights as one rank, step after step."""
    _two_ranks_like_one(
        tmp_path,
        "train.sequence_parallel_size=2",
        ["train.steps=6", "checkpoint.every_steps=null", "logging.progress_bar=false"],
    )


def test_a_logger_that_cannot_start_on_rank_0_stops_every_rank(tmp_path, monkeypatch):
    """W&B starts on rank 0 only; its failure must reach the other ranks, which would otherwise wait
    in the first collective for ever (a hang instead of one line)."""
    from grpo_ds.config.loading import load_recipe
    from grpo_ds.errors import UserError

    failure = UserError(
        "logging.wandb_project", "Weights & Biases could not start the run (timed out)"
    )

    # rank 1 of 2: its logger starts; rank 0's failure arrives through disk.agree's collectives
    class Rank1:
        is_main, rank, world_size = False, 1, 2

        def all_reduce_max(self, flag):
            # rank 0 failed (the flag names the lowest failing rank as world_size - rank)
            flag.fill_(2)

    def broadcast_object_list(box, src):
        assert src == 0
        box[0] = failure

    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broadcast_object_list)
    recipe = load_recipe(TINY, {"run.output_dir": str(tmp_path)})
    session = session_module.Session(SimpleNamespace(recipe=recipe), Rank1(), stop=None)
    session.ctx.run_dir = tmp_path / "tiny_cpu"
    with pytest.raises(UserError) as err:
        session._start_logger()
    assert err.value is failure
