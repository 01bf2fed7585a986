"""resolve_deepspeed_config: "auto" keys filled from the recipe and world size, contradictions
named, files found."""

import json
import math

import pytest

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.errors import UserError

# 5 prompts x 4 completions = 20 samples, 3 per micro-batch: gas differs at world sizes 1, 2, 3 (7,
# 4, 3)
BASE = {
    "rollout": {"prompts_per_step": 5, "group_size": 4},
    "train": {"micro_batch_samples_per_gpu": 3, "lr": 0.001},
}


def recipe(deepspeed=None, **sections):
    raw = json.loads(json.dumps(BASE))
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    if deepspeed is not None:
        raw["deepspeed"] = deepspeed
    return load_recipe(raw)


def resolve(deepspeed=None, world_size=1, device="cpu", **sections):
    return resolve_deepspeed_config(recipe(deepspeed, **sections), world_size, device)


def resolve_error(deepspeed=None, world_size=1, device="cpu", **sections) -> UserError:
    with pytest.raises(UserError) as info:
        resolve(deepspeed, world_size, device, **sections)
    return info.value


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2))
    return path


# ------------------------------------------------------------------------------------ batch algebra


@pytest.mark.parametrize(
    "spos, world_size, gas",
    [
        (None, 1, 7),
        (None, 2, 4),
        (None, 3, 3),  # ceil(ceil(20 / W) / 3)
        (10, 1, 4),
        (10, 2, 2),
        (10, 3, 2),  # ceil(ceil(10 / W) / 3)
    ],
)
@pytest.mark.parametrize(
    "deepspeed", ["ds_configs/zero3.json", {"zero_optimization": {"stage": 3}}]
)
def test_auto_batch_keys(deepspeed, spos, world_size, gas):
    cfg = resolve(deepspeed, world_size, train={"samples_per_optimizer_step": spos})
    samples = spos or 20
    micro = 3
    assert cfg["train_micro_batch_size_per_gpu"] == micro
    assert (
        cfg["gradient_accumulation_steps"]
        == gas
        == math.ceil(math.ceil(samples / world_size) / micro)
    )
    assert cfg["train_batch_size"] == micro * gas * world_size
    assert cfg["gradient_clipping"] == 1.0
    # one rank: stage 1 (below)
    assert cfg["zero_optimization"]["stage"] == (1 if world_size == 1 else 3)
    assert "auto" not in json.dumps(cfg)


def test_repo_file_keeps_its_zero_settings():
    cfg = resolve("ds_configs/zero3.json", world_size=2)
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 50000000


def test_inline_object_is_not_modified():
    inline = {"zero_optimization": {"stage": 3}, "train_batch_size": "auto"}
    r = recipe(inline)
    resolve_deepspeed_config(r, 2)
    assert r.deepspeed == inline


def test_gradient_clipping_follows_max_grad_norm():
    assert resolve(train={"max_grad_norm": 0.5})["gradient_clipping"] == 0.5


def test_managed_gradient_accumulation_is_off():
    assert resolve()["managed_gradient_accumulation"] is False
    assert (
        resolve({"managed_gradient_accumulation": "auto"})["managed_gradient_accumulation"] is False
    )
    err = resolve_error({"managed_gradient_accumulation": True})
    assert err.where == "deepspeed: managed_gradient_accumulation"


# --------------------------------------------------------------------- hard-coded numbers in a file


# world size 2: micro 3, gas ceil(10 / 3) = 4, train_batch_size 24, clipping 1.0, lr 0.001
@pytest.mark.parametrize(
    "keys, bad, good",
    [
        (["train_batch_size"], 20, 24),
        (["train_micro_batch_size_per_gpu"], 4, 3),
        (["gradient_accumulation_steps"], 5, 4),
        (["gradient_clipping"], 0.5, 1.0),
        (["optimizer", "params", "lr"], 0.01, 0.001),
        (["optimizer", "params", "weight_decay"], 0.1, 0.0),
    ],
)
def test_contradicting_number_names_what_to_set(tmp_path, keys, bad, good):
    ds = {"zero_optimization": {"stage": 3}}
    node = ds
    for k in keys[:-1]:
        node = node.setdefault(k, {"type": "AdamW"} if k == "optimizer" else {})
    node[keys[-1]] = bad
    path = write_json(tmp_path / "ds.json", ds)
    with pytest.raises(UserError) as info:
        resolve(str(path), world_size=2)
    err = info.value
    dotted = ".".join(keys)
    assert err.where == f"{path}: {dotted}"
    assert err.what.startswith(f"is {json.dumps(bad)} but the recipe gives {json.dumps(good)}")
    assert err.fix == f'set {dotted} to "auto" (grpo_ds derives it) or to {json.dumps(good)}'


def test_train_batch_size_message_explains_the_product(tmp_path):
    path = write_json(tmp_path / "ds.json", {"train_batch_size": 7})
    with pytest.raises(UserError) as info:
        resolve(str(path), world_size=3)
    assert "micro 3 x gradient accumulation 3 x world size 3" in info.value.what


def test_contradicting_betas(tmp_path):
    path = write_json(
        tmp_path / "ds.json", {"optimizer": {"type": "AdamW", "params": {"betas": [0.8, 0.99]}}}
    )
    with pytest.raises(UserError) as info:
        resolve(str(path))
    assert info.value.where == f"{path}: optimizer.params.betas"
    assert "[0.8, 0.99]" in info.value.what and "[0.9, 0.999]" in info.value.what


def test_contradicting_betas_fix_names_the_value():
    with pytest.raises(UserError) as info:
        resolve({"optimizer": {"params": {"betas": [0.8, 0.99]}}})
    assert "[0.9, 0.999]" in info.value.fix


def test_agreeing_hard_coded_values_are_accepted(tmp_path):
    ds = {
        "train_batch_size": 24,
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 0.001, "betas": [0.9, 0.999], "weight_decay": 0},
        },
        "zero_optimization": {"stage": 3},
    }
    cfg = resolve(str(write_json(tmp_path / "ds.json", ds)), world_size=2)
    assert (
        cfg["train_batch_size"],
        cfg["train_micro_batch_size_per_gpu"],
        cfg["gradient_accumulation_steps"],
    ) == (24, 3, 4)
    assert cfg["optimizer"]["params"]["lr"] == 0.001 and cfg["optimizer"]["params"]["betas"] == [
        0.9,
        0.999,
    ]


def test_unsupported_optimizer():
    err = resolve_error({"optimizer": {"type": "SGD", "params": {}}})
    assert err.where == "deepspeed: optimizer.type" and "'SGD'" in err.what and "AdamW" in err.fix


# ---------------------------------------------------------------------------------------- precision


@pytest.mark.parametrize(
    "dtype, bf16, fp16",
    [("float32", False, False), ("bfloat16", True, False), ("float16", False, True)],
)
@pytest.mark.parametrize("deepspeed", ["ds_configs/zero3.json", {}])
def test_precision_follows_model_dtype(deepspeed, dtype, bf16, fp16):
    cfg = resolve(deepspeed, model={"dtype": dtype})
    assert cfg["bf16"]["enabled"] is bf16
    assert cfg["fp16"]["enabled"] is fp16


def test_precision_contradiction():
    err = resolve_error({"bf16": {"enabled": True}}, model={"dtype": "float32"})
    assert err.where == "deepspeed: bf16.enabled"
    assert "model.dtype 'float32'" in err.what and "false" in err.fix
    err = resolve_error({"fp16": {"enabled": False}}, model={"dtype": "float16"})
    assert err.where == "deepspeed: fp16.enabled" and "true" in err.fix
    assert (
        resolve({"bf16": {"enabled": True}}, model={"dtype": "bfloat16"})["bf16"]["enabled"] is True
    )


def test_precision_section_that_is_not_an_object_is_a_user_error():
    resolve_error({"bf16": True})


# ----------------------------------------------------------------------------- optimizer, scheduler


def test_torch_adam_on_cpu_only():
    assert resolve(device="cpu")["optimizer"]["params"]["torch_adam"] is True
    assert "torch_adam" not in resolve(device="cuda")["optimizer"]["params"]
    # an offloaded optimizer runs DeepSpeed's CPU Adam, not torch's
    assert (
        "torch_adam"
        not in resolve("ds_configs/zero3_offload.json", device="cpu")["optimizer"]["params"]
    )


def test_torch_adam_is_fused_unless_the_file_says_otherwise():
    assert resolve(device="cpu")["optimizer"]["params"]["fused"] is True
    assert "fused" not in resolve(device="cuda")["optimizer"]["params"]
    assert (
        "fused" not in resolve("ds_configs/zero3_offload.json", device="cpu")["optimizer"]["params"]
    )
    # torch refuses fused together with foreach
    for params in ({"fused": False}, {"foreach": True}):
        cfg = resolve(
            {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": params}}
        )
        assert cfg["optimizer"]["params"].get("fused", False) is False


def test_optimizer_filled_from_the_recipe():
    params = resolve(train={"weight_decay": 0.01, "adam_betas": [0.8, 0.95]})["optimizer"]["params"]
    assert resolve()["optimizer"]["type"] == "AdamW"
    assert (params["lr"], params["weight_decay"], params["betas"]) == (0.001, 0.01, [0.8, 0.95])


def test_scheduler_only_with_warmup():
    assert "scheduler" not in resolve(train={"warmup_steps": 0})
    sched = resolve(train={"warmup_steps": 5})["scheduler"]
    assert sched["type"] == "WarmupLR"
    assert sched["params"]["warmup_num_steps"] == 5 and sched["params"]["warmup_max_lr"] == 0.001
    assert sched["params"]["warmup_min_lr"] == 0.0


def test_scheduler_in_file_is_checked():
    err = resolve_error(
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
        train={"warmup_steps": 5},
    )
    assert err.where == "deepspeed: scheduler.params.warmup_num_steps" and "to 5" in err.fix


def test_leftover_auto_in_unknown_key():
    err = resolve_error({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert err.where == "deepspeed: zero_optimization.reduce_bucket_size"
    assert '"auto"' in err.what and err.fix


# -------------------------------------------------------------------------------------------- files


def test_missing_deepspeed_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = resolve_error("no_such/ds.json")
    assert err.where == "deepspeed"
    assert err.what.startswith("no_such/ds.json not found") and "zero3.json" in err.fix


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": "auto",\n  "zero_optimization": {"stage": 3,}\n}\n')
    err = resolve_error(str(path))
    assert err.where.startswith(f"{path}:3:")
    assert err.what.startswith("invalid JSON") and err.fix


def test_deepspeed_file_must_be_an_object(tmp_path):
    path = write_json(tmp_path / "ds.json", [1, 2])
    err = resolve_error(str(path))
    assert err.where == str(path) and "JSON object" in err.what


def test_file_found_next_to_the_recipe(tmp_path, monkeypatch):
    folder = tmp_path / "recipes"
    folder.mkdir()
    write_json(folder / "my_ds.json", {"zero_optimization": {"stage": 2}})
    recipe_path = write_json(folder / "r.json", {**BASE, "deepspeed": "my_ds.json"})
    monkeypatch.chdir(tmp_path)  # the working directory has no my_ds.json
    cfg = resolve_deepspeed_config(load_recipe(recipe_path), 1)
    assert cfg["zero_optimization"]["stage"] == 2


def test_working_directory_is_looked_in_first(tmp_path, monkeypatch):
    folder = tmp_path / "recipes"
    folder.mkdir()
    write_json(folder / "my_ds.json", {"zero_optimization": {"stage": 2}})
    write_json(tmp_path / "my_ds.json", {"zero_optimization": {"stage": 1}})
    recipe_path = write_json(folder / "r.json", {**BASE, "deepspeed": "my_ds.json"})
    monkeypatch.chdir(tmp_path)
    assert resolve_deepspeed_config(load_recipe(recipe_path), 1)["zero_optimization"]["stage"] == 1


def test_optimizer_block_without_type_is_adamw():
    """An inline block that only tunes eps must still give DeepSpeed an optimizer (else it builds
    none)."""
    cfg = resolve_deepspeed_config(
        load_recipe({"deepspeed": {"optimizer": {"params": {"eps": 1e-6}}}}), 1, "cpu"
    )
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["eps"] == 1e-6


# ------------------------------------------------------------------------------- tensor parallelism


def test_tensor_parallel_counts_data_parallel_ranks_and_fills_autotp():
    # world 4 = dp 2 x tp 2: 20 samples / dp 2 = 10 per rank, 3 per micro-batch -> 4 micro-batches
    # (not 2 as for dp 4)
    cfg = resolve(
        {"zero_optimization": {"stage": 1}}, world_size=4, train={"tensor_parallel_size": 2}
    )
    assert cfg["gradient_accumulation_steps"] == 4
    # ZeRO 0-2: DeepSpeed counts every rank, the TP ones included
    assert cfg["train_batch_size"] == 3 * 4 * 4
    assert cfg["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}


def test_tensor_parallel_under_zero3_leaves_train_batch_size_out():
    cfg = resolve(
        {"zero_optimization": {"stage": 3}}, world_size=4, train={"tensor_parallel_size": 2}
    )
    assert "train_batch_size" not in cfg and cfg["gradient_accumulation_steps"] == 4
    err = resolve_error(
        {"zero_optimization": {"stage": 3}, "train_batch_size": 48},
        world_size=4,
        train={"tensor_parallel_size": 2},
    )
    assert err.where.endswith("train_batch_size") and "two different sizes" in err.what


def test_tensor_parallel_contradictions_are_named():
    err = resolve_error(world_size=3, train={"tensor_parallel_size": 2})
    assert (
        err.where == "train.tensor_parallel_size" and "does not divide the world size 3" in err.what
    )
    assert "1, 3" in err.fix
    err = resolve_error(
        {"tensor_parallel": {"autotp_size": 4}}, world_size=4, train={"tensor_parallel_size": 2}
    )
    assert (
        err.where.endswith("tensor_parallel.autotp_size")
        and "train.tensor_parallel_size" in err.fix
    )
    err = resolve_error(
        {"tensor_parallel": {"vocab_parallel_lm_head": True}},
        world_size=2,
        train={"tensor_parallel_size": 2},
    )
    assert err.where.endswith("tensor_parallel.vocab_parallel_lm_head")
    assert "tensor_parallel" not in resolve(world_size=2)  # tp 1: nothing added


# ----------------------------------------------------------------------------- sequence parallelism


def test_sequence_parallel_counts_data_parallel_ranks_and_needs_zero3():
    # world 4 = dp 2 x sp 2: 20 samples / dp 2 = 10 per rank, 3 per micro-batch -> 4; DeepSpeed
    # (given Ulysses' groups) counts train_batch_size over dp
    cfg = resolve(
        {"zero_optimization": {"stage": 3}}, world_size=4, train={"sequence_parallel_size": 2}
    )
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_batch_size"] == 3 * 4 * 2
    err = resolve_error(
        {"zero_optimization": {"stage": 2}}, world_size=2, train={"sequence_parallel_size": 2}
    )
    assert err.where.endswith("zero_optimization.stage") and "ZeRO-3 only" in err.what
    err = resolve_error(world_size=3, train={"sequence_parallel_size": 2})
    assert (
        err.where == "train.sequence_parallel_size"
        and "does not divide the world size 3" in err.what
    )


@pytest.mark.parametrize(
    ("sections", "says"),
    [
        ({"train": {"tensor_parallel_size": 2}}, "cannot be combined"),
        ({"train": {"max_tokens_per_micro_batch": 100_000}}, "same number of rows"),
        (
            {"algorithm": {"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean"}},
            "all of its tokens on one rank",
        ),
        (
            {
                "model": {"tiny_num_heads": 2, "tiny_hidden_size": 32},
                "train": {"sequence_parallel_size": 4},
            },
            "whole heads",
        ),
    ],
)
def test_what_sequence_parallelism_cannot_take_is_refused_in_one_line(sections, says):
    raw = {"train": {"sequence_parallel_size": 2}}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    with pytest.raises(UserError) as err:
        recipe(**raw)
    assert err.value.where == "train.sequence_parallel_size" and says in err.value.what


def test_offload_optimizer_null_is_no_offload():
    # DeepSpeed's own "off"
    cfg = resolve({"zero_optimization": {"stage": 3, "offload_optimizer": None}})
    # CPU, no offload: torch's Adam, as without the key
    assert cfg["optimizer"]["params"]["torch_adam"] is True


# ------------------------------------------------------------------------------------- one rank


def test_one_rank_runs_zero3_as_stage1():
    """One rank has nothing to partition: stage 1 (same fp32 master weights and optimizer states),
    the file's other ZeRO settings kept, the stage-3-only ones and overlap_comm dropped; the note
    names the file and the way back."""
    from grpo_ds.config.deepspeed import one_rank_stage_note

    r = recipe("ds_configs/zero3.json")
    cfg = resolve_deepspeed_config(r, 1, "cpu")
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 1 and zero["overlap_comm"] is False
    assert zero["reduce_bucket_size"] == 50000000 and zero["contiguous_gradients"] is True
    assert not [k for k in zero if k.startswith("stage3_")]
    note = one_rank_stage_note(r, cfg)
    assert (
        note.startswith("ds_configs/zero3.json: ZeRO stage 3 runs as stage 1")
        and "zero3_on_one_rank" in note
    )
    assert one_rank_stage_note(r, resolve_deepspeed_config(r, 2, "cpu")) is None


@pytest.mark.parametrize(
    ("deepspeed", "world_size", "train"),
    [
        ("ds_configs/zero3.json", 2, {}),  # two ranks partition
        ("ds_configs/zero3.json", 1, {"zero3_on_one_rank": True}),  # asked for
        ("ds_configs/zero3_offload.json", 1, {}),  # parameter offload exists only under stage 3
        ("ds_configs/zero3_offload_optimizer.json", 1, {}),
    ],
)
def test_zero3_is_kept(deepspeed, world_size, train):
    cfg = resolve(deepspeed, world_size, train=train)
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_other_stages_are_left_alone_on_one_rank(stage):
    assert resolve({"zero_optimization": {"stage": stage}})["zero_optimization"] == {"stage": stage}


@pytest.mark.parametrize(
    ("deepspeed", "world_size", "sections", "shares"),
    [
        ("ds_configs/zero3.json", 1, {}, True),  # stage 1 on one rank: the module is whole
        ("ds_configs/zero3.json", 2, {}, False),  # ZeRO-3 partitions it
        ("ds_configs/zero3.json", 1, {"train": {"zero3_on_one_rank": True}}, False),
        ("ds_configs/zero3_offload.json", 1, {}, False),
        (
            {"zero_optimization": {"stage": 2}},
            2,
            {},
            True,
        ),  # ZeRO-2 holds every weight on every rank
        # AutoTP splits it
        ({"zero_optimization": {"stage": 1}}, 2, {"train": {"tensor_parallel_size": 2}}, False),
        ("ds_configs/zero3.json", 1, {"rollout": {"engine": "agent", "env": "calculator"}}, True),
        # vLLM holds its own weights
        ("ds_configs/zero3.json", 1, {"rollout": {"engine": "vllm"}}, False),
        ("ds_configs/zero3.json", 1, {"model": {"lora_rank": 4}}, True),  # the peft model generates
        # a copy with the adapters merged in
        ("ds_configs/zero3.json", 2, {"model": {"lora_rank": 4}}, False),
    ],
)
def test_the_hf_engine_generates_with_the_policy_where_every_rank_holds_it_whole(
    deepspeed, world_size, sections, shares
):
    from grpo_ds.config.deepspeed import rollout_shares_policy

    r = recipe(deepspeed, **sections)
    assert rollout_shares_policy(r, resolve_deepspeed_config(r, world_size, "cpu")) is shares


# ---------------------------------------------------------------------------------------- lean bf16


LEAN = {"model": {"dtype": "bfloat16"}, "train": {"lean_bf16": True}}


def test_lean_bf16_turns_on_deepspeeds_bf16_master_weights_and_optimizer_states():
    assert resolve(**LEAN)["bf16"] == {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    for world, device in ((2, "cpu"), (1, "cuda")):  # ZeRO-3 at two ranks; the GPU's optimizer too
        assert (
            resolve(world_size=world, device=device, **LEAN)["bf16"]["bf16_optimizer_states"]
            is True
        )
    # off: DeepSpeed's fp32 master, as before
    default = resolve(model={"dtype": "bfloat16"})["bf16"]
    assert default == {"enabled": True}


def test_lean_bf16_is_refused_where_deepspeed_cannot_keep_a_bf16_master(tmp_path):
    with pytest.raises(UserError, match='needs model.dtype "bfloat16"'):
        recipe(train={"lean_bf16": True})  # float32 weights
    offload = resolve_error("ds_configs/zero3_offload.json", **LEAN)
    assert offload.where == "train.lean_bf16" and "offload" in str(offload)
    stage0 = write_json(tmp_path / "zero0.json", {"zero_optimization": {"stage": 0}})
    assert "ZeRO stage 1, 2 or 3" in str(resolve_error(str(stage0), **LEAN))
    says_no = write_json(
        tmp_path / "no.json",
        {"zero_optimization": {"stage": 1}, "bf16": {"bf16_optimizer_states": False}},
    )
    error = resolve_error(str(says_no), **LEAN)
    assert error.where.endswith("bf16.bf16_optimizer_states") and "train.lean_bf16" in str(error)
