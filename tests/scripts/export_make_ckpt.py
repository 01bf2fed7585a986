"""Make run folders with two ZeRO-3 checkpoints each for tests/test_export.py (launched by
`deepspeed`).

    deepspeed --num_gpus W tests/scripts/export_make_ckpt.py OUT_ROOT KIND[,KIND]

One run folder OUT_ROOT/KIND per kind: "tiny" trains model.path "builtin:tiny"; "hf_tied" first
saves a tiny Llama with tied embeddings (and a generation_config.json of its own) as a local HF
folder OUT_ROOT/hf_tied_base and trains model.path = that folder. Each run writes
RUN_DIR/recipe.json, wraps the model in a ZeRO-3 train engine, and twice runs one optimizer step on
random tokens and saves a checkpoint in the run-folder layout (step_00000001, step_00000002;
``latest`` names the second). For each saved step it records, from the engine itself, the full
parameters and the logits on a fixed batch of texts (every rank joins the forward, since ZeRO-3
gathers parameters collectively): RUN_DIR/expected_logits.pt holds
``{"texts": [...], "input_ids", "attention_mask", "steps": {step: {"logits", "params"}}}``.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.ranks import end_launched_rank, init_distributed
from grpo_ds.model.engine import create_train_engine
from grpo_ds.model.loading import load_model, load_tokenizer
from grpo_ds.model.tiny import build_tiny_tokenizer
from grpo_ds.model.weight_gather import gathered_named_parameters
from grpo_ds.run.checkpoint import _sha256

TEXTS = ["Hello, world!", "2+2=4"]  # different lengths: the shorter one is left-padded
TINY_MODEL = {
    "path": "builtin:tiny",
    "tiny_hidden_size": 32,
    "tiny_num_layers": 2,
    "tiny_num_heads": 4,
}
# must survive the export
HF_GENERATION = {"max_new_tokens": 7, "do_sample": True, "temperature": 0.5}


def recipe_dict(model: dict) -> dict:
    return {
        "run": {"name": "export_test", "seed": 3},
        "model": model,
        "rollout": {"prompts_per_step": 2, "group_size": 2},
        "train": {"micro_batch_samples_per_gpu": 2, "lr": 1e-2},
        "deepspeed": {"zero_optimization": {"stage": 3}},
    }


def save_tied_hf_model(folder: Path) -> None:
    """A local HF model folder: tiny Llama whose lm_head shares the embedding, the tiny tokenizer, a
    generation config."""
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0, **HF_GENERATION)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def save_checkpoint(engine, run_dir: Path, step: int, is_main: bool, dist) -> None:
    """The checkpoint layout grpo_ds.run.checkpoint writes: ds/ by DeepSpeed, trainer_state.json,
    manifest.json, latest."""
    name = f"step_{step:08d}"
    folder = run_dir / "checkpoints" / name
    engine.save_checkpoint(save_dir=str(folder), tag="ds")
    dist.barrier()
    if is_main:
        (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
        files = {
            p.relative_to(folder).as_posix(): _sha256(p)
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        (folder / "manifest.json").write_text(json.dumps({"step": step, "files": files}, indent=1))
        (run_dir / "checkpoints" / "latest").write_text(name)
    dist.barrier()


def main(out_root: Path, kinds: list[str]) -> None:
    dist = init_distributed()
    for kind in kinds:
        model = TINY_MODEL
        if kind == "hf_tied":
            base = out_root / "hf_tied_base"
            if dist.is_main:
                save_tied_hf_model(base)
            dist.barrier()
            model = {"path": str(base)}
        make_run(out_root / kind, recipe_dict(model), dist)


def make_run(run_dir: Path, raw_recipe: dict, dist) -> None:
    recipe = load_recipe(raw_recipe)
    tokenizer = load_tokenizer(recipe.model)
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=1))
    model = load_model(recipe.model, len(tokenizer), recipe.run.seed)
    engine = create_train_engine(model, resolve_deepspeed_config(recipe, dist.world_size, "cpu"))
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    expected = {
        "texts": TEXTS,
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "steps": {},
    }
    # different tokens per rank, like real data shards
    g = torch.Generator().manual_seed(1000 + dist.rank)
    for step in (1, 2):
        engine.module.train()
        tokens = torch.randint(5, len(tokenizer), (2, 16), generator=g)  # (micro, T)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        save_checkpoint(engine, run_dir, step, dist.is_main, dist)
        engine.module.eval()
        with torch.no_grad():
            # (B, T, V)
            logits = engine(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
        params = {
            name: t.detach().clone() for name, t in gathered_named_parameters(engine.module, 2**20)
        }
        expected["steps"][step] = {"logits": logits.float().clone(), "params": params}
    if dist.is_main:
        torch.save(expected, run_dir / "expected_logits.pt")
    dist.barrier()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(Path(args[0]), args[1].split(","))
    # past the teardown that sometimes aborts a finished rank (grpo_ds.distributed.ranks)
    end_launched_rank(0)
