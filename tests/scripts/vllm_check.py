"""Real vLLM (its CPU build) against the trainer, in the vLLM test environment (.ci/vllm-venv), one
rank or several through the ``deepspeed`` launcher:

    python tests/scripts/vllm_check.py OUT_JSON [sync] [agent] [lora] [key=value ...]

Each rank builds the policy and the vllm engine as grpo_ds.train does (recipes/tiny_vllm_cpu.json
plus the overrides) and writes OUT_JSON.rank<r>:

- sync: after each of 3 optimizer steps (random gradients) and its weight sync, vLLM's log-probs of
  a fixed sequence (prompt log-probs) against the trainer's fp32 log-softmax, and the log-probs vLLM
  reports for the tokens it sampled against the trainer's for the same tokens; then one more
  optimizer step without a sync, whose gap shows that the comparison sees stale weights.
- agent: multi-turn episodes (the calculator environment) whose turns vLLM samples: the model
  tokens' sampler log-probs against the trainer's on the whole sequence, observation tokens masked
  with log-prob 0.
- lora: a LoRA policy (adapters on q_proj and v_proj, so vLLM's fused qkv needs k_proj beside them),
  synced after each of 2 optimizer steps: vLLM against the trainer's merged model.
- continuous: continuous generation (grpo_ds.rollout.vllm_continuous): two steps' groups in a
  running batch of 2 groups against the batch-by-batch engine's samples; then new weights loaded
  while a group is in flight: the tokens sampled after it against the trainer's new log-probs, and
  their versions.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

# this checkout's grpo_ds, whatever is installed
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from grpo_ds.config.deepspeed import resolve_deepspeed_config  # noqa: E402
from grpo_ds.config.loading import load_recipe  # noqa: E402
from grpo_ds.distributed import launcher  # noqa: E402
from grpo_ds.distributed.ranks import init_distributed  # noqa: E402
from grpo_ds.envs.calculator import CalculatorEnv  # noqa: E402
from grpo_ds.model.loading import load_model, load_tokenizer  # noqa: E402
from grpo_ds.model.policy import Policy  # noqa: E402
from grpo_ds.rollout.agent import AgentRolloutEngine  # noqa: E402
from grpo_ds.rollout.base import SamplingParams  # noqa: E402
from grpo_ds.rollout.hf_continuous import GroupRequest  # noqa: E402
from grpo_ds.rollout.vllm import VLLMRolloutEngine, VLLMSettings  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BUCKET = 1 << 16  # small buckets: several per sync
TEMPERATURE = 1.0


def build(overrides: dict):
    recipe = load_recipe(REPO / "recipes" / "tiny_vllm_cpu.json", overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist = init_distributed()
    ds_config = resolve_deepspeed_config(recipe, world, "cpu")
    tokenizer = load_tokenizer(recipe.model)
    rollout = VLLMRolloutEngine(
        VLLMSettings.from_recipe(recipe),
        tokenizer,
        lambda: load_model(recipe.model, len(tokenizer), recipe.run.seed),
    )
    policy = Policy.build(recipe, ds_config, len(tokenizer), announce=False)
    return recipe, dist, tokenizer, rollout, policy


def optimizer_step(policy: Policy, tokenizer, seed: int) -> None:
    """One optimizer step of random direction: a weighted sum of a batch's log-probs."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tokenizer), (4, 12), generator=generator)
    logits = policy.engine(input_ids=ids).logits.float()
    loss = (torch.log_softmax(logits, -1) * torch.randn(logits.shape, generator=generator)).mean()
    policy.engine.backward(loss)
    policy.engine.step()


def sync(policy: Policy, rollout: VLLMRolloutEngine) -> None:
    rollout.update_weights(policy.rollout_weights(BUCKET, rollout.whole_layers))


def trainer_logprobs(policy: Policy, sequence: list[int], start: int) -> torch.Tensor:
    """log softmax(logits / T) of sequence[start:], from the trainer's module in fp32 (every rank
    calls it)."""
    with torch.no_grad():
        logits = policy.engine.module(input_ids=torch.tensor([sequence])).logits[0].float()
    logprobs = torch.log_softmax(logits / TEMPERATURE, -1)[start - 1 : len(sequence) - 1]
    return logprobs.gather(-1, torch.tensor(sequence[start:])[:, None])[:, 0]


def vllm_prompt_logprobs(rollout: VLLMRolloutEngine, sequence: list[int]) -> torch.Tensor:
    """vLLM's log-probs of sequence[1:] (prompt log-probs: the weights vLLM holds now, on a fixed
    sequence)."""
    params = rollout._vllm.SamplingParams(
        max_tokens=1, temperature=TEMPERATURE, prompt_logprobs=0, seed=0
    )
    out = rollout.llm.generate(
        [{"prompt_token_ids": sequence}], sampling_params=params, use_tqdm=False
    )[0]
    return torch.tensor(
        [
            position[token].logprob
            for position, token in zip(out.prompt_logprobs[1:], sequence[1:], strict=True)
        ]
    )


def fixed_gap(policy, rollout, tokenizer) -> float:
    sequence = tokenizer.encode("12+34=46 7+8=15 3+3=6")
    return (
        (vllm_prompt_logprobs(rollout, sequence) - trainer_logprobs(policy, sequence, 1))
        .abs()
        .max()
        .item()
    )


def sampled_gap(policy, rollout, tokenizer, seed: int) -> float:
    prompts = [tokenizer.encode("5+7="), tokenizer.encode("21+3=")]
    out = rollout.generate(
        prompts, 4, SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, seed=seed)
    )
    gaps = [
        (torch.tensor(lp) - trainer_logprobs(policy, p + r, len(p))).abs().max().item()
        for p, r, lp in zip(out.prompt_ids, out.response_ids, out.sampler_logprobs, strict=True)
    ]
    return max(gaps)


def check_sync(report: dict, policy, rollout, tokenizer) -> None:
    report["sync"] = {"fixed_gap": [], "sampled_gap": []}
    for step in range(3):
        optimizer_step(policy, tokenizer, seed=step)
        sync(policy, rollout)
        report["sync"]["fixed_gap"].append(fixed_gap(policy, rollout, tokenizer))
        report["sync"]["sampled_gap"].append(sampled_gap(policy, rollout, tokenizer, seed=step))
    # no sync: vLLM still holds the weights of the step before
    optimizer_step(policy, tokenizer, seed=99)
    report["sync"]["unsynced_gap"] = fixed_gap(policy, rollout, tokenizer)


def check_agent(report: dict, policy, rollout, tokenizer, recipe) -> None:
    agent = AgentRolloutEngine(
        rollout,
        tokenizer,
        lambda: CalculatorEnv(),
        max_turns=3,
        max_total_tokens=16,
        batch_prompts=8,
    )
    rows = [{"prompt": "5+7=", "answer": "12"}, {"prompt": "21+3=", "answer": "24"}]
    out = agent.generate(
        [tokenizer.encode(r["prompt"]) for r in rows],
        3,
        SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, seed=5),
        rows=rows,
    )
    gaps, observed, turns = [], 0, 0
    for i in range(len(out)):
        prompt, response, mask = out.prompt_ids[i], out.response_ids[i], out.token_loss_mask(i)
        expected = trainer_logprobs(policy, prompt + response, len(prompt))
        sampled = torch.tensor(out.sampler_logprobs[i])
        model = torch.tensor(mask, dtype=torch.bool)
        gaps.append((sampled[model] - expected[model]).abs().max().item() if model.any() else 0.0)
        assert (sampled[~model] == 0).all(), "observation tokens carry a sampler log-prob"
        observed += int((~model).sum())
        turns += sum(1 for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1]))
    report["agent"] = {
        "gap": max(gaps),
        "samples": len(out),
        "observation_tokens": observed,
        "model_turns": turns,
        "finish": sorted(set(out.finish_reason)),
    }


def check_continuous(report: dict, policy, rollout, tokenizer) -> None:
    sync(policy, rollout)
    G = 4
    prompts = [tokenizer.encode(p) for p in ("5+7=", "21+3=", "9*9=", "1", "12-5=")]
    steps = {s: SamplingParams(12, temperature=TEMPERATURE, seed=40 + s) for s in (1, 2)}
    expected = {s: rollout.generate(prompts, G, params) for s, params in steps.items()}
    decoder = rollout.continuous(2 * G)
    queued = [
        GroupRequest(s, g, prompts[g], G, replace(steps[s], first_prompt=g))
        for g in range(len(prompts))
        for s in steps
    ]
    got, most = {}, 0
    while queued or decoder.rows_in_flight:
        while queued and decoder.free_rows >= G:
            decoder.admit(queued.pop(0))
        most = max(most, decoder.rows_in_flight)
        for group in decoder.step():
            got[(group.step, group.group)] = group.rollouts
    same, gaps = True, []
    for s, batch in expected.items():
        for g in range(len(prompts)):
            rows = range(g * G, (g + 1) * G)
            group = got[(s, g)]
            same &= group.response_ids == [batch.response_ids[i] for i in rows]
            gaps += [
                abs(a - b)
                for i, mine in zip(rows, group.sampler_logprobs, strict=True)
                for a, b in zip(mine, batch.sampler_logprobs[i], strict=False)
            ]
    # new weights while one group is 4 tokens in
    decoder = rollout.continuous(2 * G)
    prompt = tokenizer.encode("5+7=")
    decoder.admit(GroupRequest(3, 0, prompt, G, SamplingParams(16, TEMPERATURE, seed=7)))
    done = []
    for _ in range(4):
        done += decoder.step()
    optimizer_step(policy, tokenizer, seed=123)
    decoder.load_weights(policy.rollout_weights(BUCKET, rollout.whole_layers), version=1)
    while decoder.rows_in_flight:
        done += decoder.step()
    out = done[0].rollouts
    new_gap, old_gap = 0.0, []
    for i in range(len(out)):
        versions = torch.tensor(out.token_versions[i])
        trainer = trainer_logprobs(policy, prompt + out.response_ids[i], len(prompt))
        gap = (torch.tensor(out.sampler_logprobs[i]) - trainer).abs()
        if (versions == 1).any():
            new_gap = max(new_gap, gap[versions == 1].max().item())
        if (versions == 0).any():
            old_gap.append(gap[versions == 0].max().item())
    report["continuous"] = {
        "same_samples": same,
        "logprob_gap": max(gaps),
        "most_rows": most,
        "lengths": sorted({len(r) for b in got.values() for r in b.response_ids}),
        "versions": out.token_versions,
        "new_version_gap": new_gap,
        "old_version_gap": max(old_gap),
    }


def main() -> None:
    # the deepspeed launcher adds it
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    out_path = Path(args[0])
    modes = [a for a in args[1:] if "=" not in a] or ["sync"]
    overrides = dict(a.split("=", 1) for a in args[1:] if "=" in a)
    overrides = {
        k: json.loads(v) if v[:1] in "0123456789[{tfn-" else v for k, v in overrides.items()
    }
    report: dict = {}
    if "sync" in modes or "agent" in modes:
        recipe, dist, tokenizer, rollout, policy = build(overrides)
        # a plain process is not launched, even after vLLM has started
        report["launched"] = launcher.launched()
        if "sync" in modes:
            check_sync(report, policy, rollout, tokenizer)
        if "agent" in modes:
            sync(policy, rollout)
            check_agent(report, policy, rollout, tokenizer, recipe)
    if "continuous" in modes:
        recipe, dist, tokenizer, rollout, policy = build(overrides)
        check_continuous(report, policy, rollout, tokenizer)
    if "lora" in modes:
        lora = {
            **overrides,
            "model.lora_rank": 4,
            "model.lora_target_modules": ["q_proj", "v_proj"],
        }
        recipe, dist, tokenizer, rollout, policy = build(lora)
        report["lora"] = {"fixed_gap": [], "whole_layers": rollout.whole_layers}
        for step in range(2):
            optimizer_step(policy, tokenizer, seed=10 + step)
            sync(policy, rollout)
            report["lora"]["fixed_gap"].append(fixed_gap(policy, rollout, tokenizer))
    Path(f"{out_path}.rank{dist.rank}").write_text(json.dumps(report))
    rollout.close()


if __name__ == "__main__":
    main()
