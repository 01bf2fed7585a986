"""The agent rollout engine: turn layout, loss mask, token exactness (what the trainer sees is what
was sampled), zero gradient through observation tokens, limits and determinism (loading environments
by name: tests/envs/test_loading.py)."""

import math

import pytest
import torch

from grpo_ds import kernels
from grpo_ds.envs import CalculatorEnv, StepResult
from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer
from grpo_ds.rollout import agent
from grpo_ds.rollout.agent import AgentRolloutEngine
from grpo_ds.rollout.base import Rollouts, SamplingParams
from grpo_ds.step.micro_batch import collate
from tests.algo.loss_configs import loss_config
from tests.rollout.test_hf import SAMPLINGS, all_steps_generate_left_padded, favour_eos

TOK = build_tiny_tokenizer()
EOS = TOK.eos_token_id


class EchoEnv:
    """Answers every model turn with "[obs N]", rewards turn N with N / 10, is done after
    ``done_after`` turns; records what it saw and said."""

    turn_stop = ("!",)

    def __init__(
        self, done_after: int = 99, intro: str = "", observation: str = "[obs {}]"
    ) -> None:
        self.done_after, self.intro, self.observation = done_after, intro, observation
        self.seen, self.observations, self.rewards, self.done = [], [], [], False

    def reset(self, row: dict) -> str:
        return self.intro

    def step(self, model_turn: str) -> StepResult:
        self.seen.append(model_turn)
        n = len(self.seen)
        self.observations.append(self.observation.format(n))
        self.rewards.append(n / 10)
        self.done = n >= self.done_after
        return StepResult(self.observations[-1], self.rewards[-1], self.done)


def recording(env_class, **options):
    """An env factory that keeps every environment it builds, in episode order."""
    made = []

    def factory():
        made.append(env_class(**options))
        return made[-1]

    return factory, made


def tiny_model(seed=0):
    return build_tiny_model(len(TOK), hidden_size=32, num_layers=1, num_heads=4, seed=seed)


def engine(factory, model=None, max_turns=3, max_total_tokens=24, batch_prompts=64):
    return AgentRolloutEngine.on_hf(
        model if model is not None else tiny_model(),
        TOK.pad_token_id,
        EOS,
        TOK,
        factory,
        max_turns,
        max_total_tokens,
        batch_prompts,
    )


def scripted(model, policy):
    """Make ``model`` sample, with probability ~1, the character ``policy(context_text)`` returns
    (None: EOS).

    A forward hook rewrites the last position's logits; it rebuilds each row's full context from the
    prefill input and the single tokens fed at each cached decoding step.
    """
    state = {}

    def hook(module, args, kwargs, output):
        ids = kwargs["input_ids"]
        state["seqs"] = ids.clone() if ids.shape[1] > 1 else torch.cat([state["seqs"], ids], dim=1)
        logits = output.logits[:, -1]  # (B, V)
        logits.fill_(-1e4)
        for b, seq in enumerate(state["seqs"]):
            char = policy(TOK.decode(seq, skip_special_tokens=True))
            logits[b, EOS if char is None else TOK.convert_tokens_to_ids(char)] = 1e4
        return output

    model.register_forward_hook(hook, with_kwargs=True)
    return model


def call_then_copy(context: str) -> str | None:
    """The ideal calculator policy: call with "?", then copy the value inside [...], then EOS."""
    if "[" not in context:
        return "?"
    value, after = (
        context[context.rindex("[") + 1 : context.rindex("]")],
        context[context.rindex("]") + 1 :],
    )
    return value[len(after)] if len(after) < len(value) else None


def runs(mask):
    """Maximal runs of equal loss-mask values: [(value, start, end)]."""
    out = []
    for t, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1][2] = t + 1
        else:
            out.append([m, t, t + 1])
    return [tuple(r) for r in out]


ARITH = [
    {"prompt": "3+4=", "answer": "7"},
    {"prompt": "2+2=", "answer": "4"},
    {"prompt": "0+1=", "answer": "1"},
]


def arith_prompts(rows=ARITH):
    return [TOK.encode(r["prompt"]) for r in rows]


# ------------------------------------------------------------------------------------------ layout


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_sampler_logprobs_equal_the_all_steps_path_bitwise(sampling, monkeypatch):
    """Multi-turn: every turn's generate call records one step's log-probs at a time and gives
    exactly the numbers of keeping every step's scores (tests/rollout/test_hf.py has the reference),
    with turns that end at EOS while other episodes of the same call keep sampling."""
    model = favour_eos(tiny_model(), EOS)

    def run():
        factory, _ = recording(EchoEnv, done_after=3, intro="<go>")
        return engine(factory, model, max_turns=3, max_total_tokens=40).generate(
            arith_prompts(), 3, SamplingParams(max_new_tokens=6, seed=2, **sampling), ARITH
        )

    ours = run()
    monkeypatch.setattr(agent, "generate_left_padded", all_steps_generate_left_padded)
    reference = run()
    assert ours.response_ids == reference.response_ids and ours.loss_mask == reference.loss_mask
    assert ours.finish_reason == reference.finish_reason
    assert ours.sampler_logprobs == reference.sampler_logprobs  # float lists: bitwise
    turns = [
        (ids[s:e], logprobs[s:e])
        for ids, mask, logprobs in zip(
            ours.response_ids, ours.loss_mask, ours.sampler_logprobs, strict=True
        )
        for m, s, e in runs(mask)
        if m == 1
    ]
    # reset text, turn, observation, turn, ...
    assert any(len(runs(mask)) >= 4 for mask in ours.loss_mask)
    assert any(ids[-1] == EOS and len(ids) < 6 for ids, _ in turns) and any(
        len(ids) == 6 for ids, _ in turns
    )
    assert all(lp <= 0.0 for _, logprobs in turns for lp in logprobs)


def test_random_model_layout_loss_mask_observation_tokens_and_sampler_logprobs():
    factory, envs = recording(EchoEnv, done_after=2, intro="<go>")
    model = tiny_model()
    eng = engine(factory, model, max_turns=3, max_total_tokens=24)
    temperature = 0.7
    out = eng.generate(
        arith_prompts(), 4, SamplingParams(max_new_tokens=4, temperature=temperature, seed=1), ARITH
    )
    assert len(out) == 12 and len(envs) == 12
    assert out.prompt_ids == [p for p in arith_prompts() for _ in range(4)]
    for i, env in enumerate(envs):
        ids, mask, logprobs = out.response_ids[i], out.loss_mask[i], out.sampler_logprobs[i]
        assert len(ids) == len(mask) == len(logprobs) <= 24
        assert EOS not in ids[:-1]
        segments = runs(mask)
        # the reset text first (mask 0), then model turns and observations alternate
        intro = TOK("<go>", add_special_tokens=False)["input_ids"]
        assert segments[0] == (0, 0, len(intro)) and ids[: len(intro)] == intro
        model_turns = [(s, e) for m, s, e in segments if m == 1]
        observations = [(s, e) for m, s, e in segments[1:] if m == 0]
        assert len(model_turns) == len(env.seen) <= 3
        for (s, e), text in zip(model_turns, env.seen, strict=True):
            turn = ids[s:e]
            assert (
                TOK.decode(turn[:-1] if turn[-1] == EOS else turn, skip_special_tokens=True) == text
            )
            assert all(math.isfinite(lp) and lp < 0 for lp in logprobs[s:e])
        # each observation tokenized alone, appended as is
        for k, (s, e) in enumerate(observations):
            expected = TOK(env.observations[k], add_special_tokens=False)["input_ids"]
            assert ids[s:e] == expected[: e - s]
            assert e - s == len(expected) or e == 24  # only the budget may cut one
        assert all(logprobs[t] == 0.0 for t in range(len(ids)) if mask[t] == 0)
        assert out.env_rewards[i] == pytest.approx(sum(env.rewards))
        # no observation after the last model turn: the response ends with a model token unless the
        # budget was hit
        assert mask[-1] == 1 or len(ids) == 24
        if out.finish_reason[i] == "stop":
            assert env.done or ids[-1] == EOS
        else:
            assert out.finish_reason[i] == "length"
        # the model's tokens were sampled from exactly this token history: one unpadded forward pass
        # gives the sampler's log-probs (tolerance: batched left-padded generate vs one sequence,
        # fp32 in another order)
        p = len(out.prompt_ids[i])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([out.prompt_ids[i] + ids])).logits[
                0, p - 1 : p + len(ids) - 1
            ]
        expected = torch.log_softmax(logits.float() / temperature, -1).gather(
            -1, torch.tensor(ids)[:, None]
        )[:, 0]
        trained = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(logprobs)[trained], expected[trained], rtol=1e-4, atol=1e-4
        )
    assert {"stop", "length"} >= set(out.finish_reason)


def test_scripted_model_calls_the_calculator_and_copies_the_answer():
    model = scripted(tiny_model(), call_then_copy)
    eng = engine(CalculatorEnv, model, max_turns=3, max_total_tokens=12)
    rows = ARITH + [{"prompt": "9*9=", "answer": "81"}]
    out = eng.generate(arith_prompts(rows), 2, SamplingParams(max_new_tokens=12, seed=0), rows)
    for i, row in enumerate(r for r in rows for _ in range(2)):
        value = row["answer"]
        obs = TOK.encode(f"[{value}]")
        assert out.response_ids[i] == TOK.encode("?") + obs + TOK.encode(value) + [EOS]
        assert out.loss_mask[i] == [1] + [0] * len(obs) + [1] * (len(value) + 1)
        assert out.sampler_logprobs[i][1 : 1 + len(obs)] == [0.0] * len(obs)
        assert out.finish_reason[i] == "stop"
        assert out.env_rewards[i] == pytest.approx(1.1)  # call_reward 0.1 + a correct answer 1.0
        assert out.trained_tokens(i) == len(value) + 2


def test_a_correct_answer_without_the_tool_scores_one():
    model = scripted(tiny_model(), lambda context: "7" if context.endswith("=") else None)
    out = engine(CalculatorEnv, model).generate(
        arith_prompts()[:1], 2, SamplingParams(8, seed=0), ARITH[:1]
    )
    assert out.response_ids == [TOK.encode("7") + [EOS]] * 2 and out.env_rewards == [1.0, 1.0]
    assert out.loss_mask == [[1, 1]] * 2 and out.finish_reason == ["stop", "stop"]


def test_eos_right_away_ends_the_episode_with_stop():
    factory, envs = recording(EchoEnv)
    model = scripted(tiny_model(), lambda context: None)
    out = engine(factory, model).generate(
        arith_prompts()[:1], 2, SamplingParams(8, seed=0), ARITH[:1]
    )
    assert out.response_ids == [[EOS], [EOS]] and out.finish_reason == ["stop", "stop"]
    # the env still scores the (empty) turn
    assert envs[0].seen == [""] and out.env_rewards == [0.1, 0.1]


def test_max_turns_ends_with_length_and_no_observation_after_the_last_turn():
    model = scripted(tiny_model(), lambda context: "?")  # calls forever
    out = engine(CalculatorEnv, model, max_turns=2, max_total_tokens=20).generate(
        arith_prompts()[:1], 1, SamplingParams(8, seed=0), ARITH[:1]
    )
    assert TOK.decode(out.response_ids[0]) == "?[7]?"
    assert out.loss_mask[0] == [1, 0, 0, 0, 1] and out.finish_reason == ["length"]
    assert out.env_rewards == [pytest.approx(0.1)]  # only the first call earns call_reward


def test_an_observation_past_the_budget_is_cut_and_ends_with_length():
    factory, envs = recording(EchoEnv, observation="a long observation {}")
    model = scripted(tiny_model(), lambda context: "!")  # a one-token turn ended by the stop string
    out = engine(factory, model, max_total_tokens=8).generate(
        arith_prompts()[:1], 1, SamplingParams(8, seed=0), ARITH[:1]
    )
    assert (
        out.response_ids[0]
        == TOK.encode("!") + TOK("a long observation 1", add_special_tokens=False)["input_ids"][:7]
    )
    assert out.loss_mask[0] == [1] + [0] * 7 and out.finish_reason == ["length"]


def test_a_turn_ends_at_a_multi_token_stop_string_and_at_the_per_turn_cap():
    class Tagged(EchoEnv):
        turn_stop = ("</c>",)

    factory, envs = recording(Tagged, done_after=2)

    def policy(context):
        turn = context.rsplit("]", 1)[-1] if "[" in context else context.split("=", 1)[1]
        return "1</c>zzzzz"[len(turn)] if "[obs" not in context else "x"

    out = engine(factory, scripted(tiny_model(), policy)).generate(
        arith_prompts()[:1], 1, SamplingParams(max_new_tokens=6, seed=0), ARITH[:1]
    )
    # ended by the 4-token stop string; then by the cap of 6
    assert envs[0].seen == ["1</c>", "xxxxxx"]
    assert TOK.decode(out.response_ids[0]) == "1</c>[obs 1]xxxxxx"
    # the env was done, but the last turn was cut by the per-turn cap
    assert out.finish_reason == ["length"]


def test_same_seed_same_rollouts_other_seed_differs_and_rows_must_match_prompts():
    factory, _ = recording(EchoEnv, done_after=2)
    eng = engine(factory)
    a = eng.generate(arith_prompts(), 2, SamplingParams(max_new_tokens=3, seed=5), ARITH)
    b = eng.generate(arith_prompts(), 2, SamplingParams(max_new_tokens=3, seed=5), ARITH)
    assert a == b
    c = eng.generate(arith_prompts(), 2, SamplingParams(max_new_tokens=3, seed=6), ARITH)
    assert c.response_ids != a.response_ids
    with pytest.raises(ValueError, match="one data row per prompt"):
        eng.generate(arith_prompts(), 2, SamplingParams(max_new_tokens=3), ARITH[:2])
    with pytest.raises(ValueError, match="no rows"):
        eng.generate(arith_prompts(), 2, SamplingParams(max_new_tokens=3))


def test_an_episode_does_not_depend_on_how_the_steps_prompts_are_spread():
    """All prompts in one call, or one rank per prompt (first_prompt: the rank's slice) in chunks of
    one prompt: the same episodes, turn for turn."""
    model = tiny_model()
    whole = engine(CalculatorEnv, model).generate(
        arith_prompts(), 3, SamplingParams(max_new_tokens=3, seed=5), ARITH
    )
    eng = engine(CalculatorEnv, model, batch_prompts=1)
    parts = Rollouts.concat(
        [
            eng.generate(
                arith_prompts()[i : i + 1],
                3,
                SamplingParams(max_new_tokens=3, seed=5, first_prompt=i),
                ARITH[i : i + 1],
            )
            for i in range(len(ARITH))
        ]
    )
    assert parts.response_ids == whole.response_ids and parts.loss_mask == whole.loss_mask
    for got, expected in zip(parts.sampler_logprobs, whole.sampler_logprobs, strict=True):
        # fp32 logits of other padded widths: equal to rounding
        assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(map(tuple, whole.response_ids))) > len(ARITH)


def test_chunks_of_prompts_concatenate_in_order_and_update_weights_reaches_the_model():
    eng = engine(CalculatorEnv, batch_prompts=2)
    out = eng.generate(arith_prompts(), 2, SamplingParams(max_new_tokens=2, seed=0), ARITH)
    assert out.prompt_ids == [p for p in arith_prompts() for _ in range(2)]
    assert len(out.loss_mask) == len(out.env_rewards) == 6
    donor = tiny_model(seed=1)
    assert eng.update_weights((n, p.detach()) for n, p in donor.named_parameters()) == len(
        list(donor.parameters())
    )
    assert all(
        torch.equal(a, b) for a, b in zip(eng.model.parameters(), donor.parameters(), strict=True)
    )


# ------------------------------------------------------------------------------------- trainer side


def _multi_turn_rollouts():
    """Random-model episodes with observations in the middle of most responses."""
    factory, _ = recording(EchoEnv, done_after=3)
    eng = engine(factory, max_turns=3, max_total_tokens=20)
    out = eng.generate(arith_prompts(), 2, SamplingParams(max_new_tokens=3, seed=3), ARITH)
    assert any(0 in m[:-1] and 1 in m for m in out.loss_mask)
    return out


def test_the_tokens_the_trainer_sees_are_exactly_the_tokens_the_rollout_produced():
    out = _multi_turn_rollouts()
    order = [5, 0, 3, 1, 4, 2]  # a micro-batch in any order
    mb = collate(out, order, TOK.pad_token_id, torch.device("cpu"), packed=False)
    for b, sid in enumerate(order):
        seq = out.prompt_ids[sid] + out.response_ids[sid]
        assert mb.input_ids[b, : len(seq)].tolist() == seq
        assert mb.attention_mask[b].sum().item() == len(seq)
    packed = collate(out, order, TOK.pad_token_id, torch.device("cpu"), one_row=True)
    assert packed.input_ids.tolist() == [
        [t for sid in order for t in out.prompt_ids[sid] + out.response_ids[sid]]
    ]
    # eager/sdpa: rows as wide as the longest
    rows = collate(out, order, TOK.pad_token_id, torch.device("cpu"))
    for layout in (mb, packed, rows):
        assert layout.target_ids.tolist() == [t for sid in order for t in out.response_ids[sid]]
    loss_mask = [m for sid in order for m in out.token_loss_mask(sid)]  # flat, in collate's order
    assert len(loss_mask) == mb.num_tokens
    assert mb.loss_mask.tolist() == loss_mask  # what the driver multiplies into the token weights


def test_observation_tokens_get_exactly_zero_gradient():
    out = _multi_turn_rollouts()
    order = list(range(len(out)))
    mb = collate(out, order, TOK.pad_token_id, torch.device("cpu"))
    loss_mask = torch.tensor(
        [m for sid in order for m in out.token_loss_mask(sid)], dtype=torch.float32
    )
    model = tiny_model().train()
    inputs = {
        k: v
        for k, v in mb.model_inputs().items()
        if k in ("input_ids", "position_ids", "use_cache")
    }
    hidden = model.model(**inputs).last_hidden_state  # (1, sum L_i, H) packed
    # (N_tok, H) the states that score each token
    scored = hidden.reshape(-1, hidden.shape[-1])[mb.logit_index]
    scored.retain_grad()
    # (N_tok,) non-zero for every sample
    advantages = torch.linspace(-1.0, 1.0, len(order))[mb.seq_index]
    sequence_weight = torch.full((mb.num_tokens,), 1.0 / mb.num_tokens)
    # how the driver masks
    inputs = kernels.LossInputs(mb.target_ids, advantages, sequence_weight * loss_mask)
    loss = kernels.policy_loss_from_hidden(
        scored, model.lm_head.weight, inputs, loss_config(), backend="torch"
    ).loss
    loss.backward()
    observation = loss_mask == 0
    assert observation.any() and (~observation).any()
    assert torch.equal(scored.grad[observation], torch.zeros_like(scored.grad[observation]))
    assert (scored.grad[~observation].abs().sum(dim=-1) > 0).all()
    # and the parameters get the gradient of the model tokens' loss alone
    head_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    keep = ~observation
    model_only = kernels.LossInputs(mb.target_ids[keep], advantages[keep], sequence_weight[keep])
    kernels.policy_loss_from_hidden(
        scored.detach()[keep], model.lm_head.weight, model_only, loss_config(), backend="torch"
    ).loss.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, head_grad, rtol=1e-6, atol=1e-9)


def test_rollouts_select_and_concat_keep_the_mask_and_env_rewards():
    out = _multi_turn_rollouts()
    picked = out.select([3, 1])
    assert picked.loss_mask == [out.loss_mask[3], out.loss_mask[1]]
    assert picked.env_rewards == [out.env_rewards[3], out.env_rewards[1]]
    both = Rollouts.concat([picked, out.select([0])])
    assert (
        both.response_ids == [out.response_ids[i] for i in (3, 1, 0)] and len(both.env_rewards) == 3
    )


def test_an_environment_that_raises_says_which_method():
    class Broken(EchoEnv):
        def step(self, model_turn):
            raise KeyError("answer")

    with pytest.raises(RuntimeError, match=r"environment step\(\) raised KeyError"):
        engine(Broken).generate(arith_prompts()[:1], 1, SamplingParams(2, seed=0), ARITH[:1])
