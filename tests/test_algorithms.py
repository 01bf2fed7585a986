"""Every algorithm option acts: its update differs from the default's as the reference math of
grpo_ds/algo predicts.

Each option trains through the real driver beside a default run with the same seed, so both draw the
same samples (unless the option changes sampling). tests/option_runs.py records every optimizer step
(weights before and after, advantages, token weights, loss statistics) and recomputes it with
grpo_ds/algo on an unsharded copy of the model. At the first optimizer step the option can change,
each test checks

1. that the driver did what the reference math says (``matches_reference``): the advantages and
   token weights it used are the reference's, its loss statistics are the reference's, and its
   weight change is the optimizer's step on the reference gradient;
2. that the option acts (``acts``): the reference says it changes the update by a good part of the
   update, and the measured change (option's weight change minus the default's) is that predicted
   change, in direction and size;

plus what the option should do to the quantity it owns (an advantage, a token weight, a statistic).

Some options cannot act on the first optimizer step of a rollout: there the policy is the one that
sampled (PPO ratio exactly 1, so ratio clips, dual clip and GSPO's clip do nothing) and the
reference (so the k2 and k3 KL and the KL in the reward are 0 with gradient 0; k1 is 0 but its
gradient is not). Every run therefore takes two optimizer steps per rollout; those tests check that
the first update is the default's and look at the second.
"""

import gc

import pytest
import torch

import grpo_ds
from tests.launch import REPO
from tests.option_runs import EPS, policy_model, record_run, save_test_model

K = "algorithm."
EPOCHS = {
    "train.samples_per_optimizer_step": None,
    "train.epochs_per_rollout": 2,
    "train.lr": 0.35 * EPS,
    "train.micro_batch_samples_per_gpu": 16,
}
OPTIONS = {
    "default": {"train.steps": 2},  # step 2: for kl_in_reward
    "rloo": {K + "advantage": "rloo"},
    "reinforce_pp": {K + "advantage": "reinforce_pp"},
    "dr_grpo": {K + "advantage": "dr_grpo", K + "loss_agg": "seq-mean-token-sum-norm"},
    "seq-mean-token-mean": {K + "loss_agg": "seq-mean-token-mean"},
    "seq-mean-token-sum": {K + "loss_agg": "seq-mean-token-sum"},
    # GSPO with PPO's clip range: the paper's 3e-4 / 4e-4 would clip every sequence of this run's
    # second step.
    "gspo": {K + "policy_loss": "gspo", K + "loss_agg": "seq-mean-token-mean"},
    # Ratios of negative-advantage tokens reach ~1.16 at the second optimizer step of this tiny run,
    # so the dual clip is 1.1 (the usual 3 needs a policy much further from its samples).
    # the largest ratio of a negative-advantage token at step 2 is 1.07
    "dual_clip": {K + "dual_clip": 1.05},
    "k1": {K + "kl_coef": 0.1, K + "kl_estimator": "k1"},
    "k2": {K + "kl_coef": 0.1, K + "kl_estimator": "k2"},
    "k3": {K + "kl_coef": 0.1, K + "kl_estimator": "k3"},
    "kl_in_reward": {
        K + "kl_coef": 0.1,
        K + "kl_in_reward": True,
        K + "kl_estimator": "k1",
        "train.steps": 2,
    },
    "rollout_is_cap": {K + "rollout_is_cap": 2.0},
    # the sampler's log-probs moved (SAMPLER_SHIFTS)
    "rollout_is_cap_shifted": {K + "rollout_is_cap": 2.0},
    "mask_truncated": {K + "mask_truncated": True},
    "overlong": {K + "overlong_buffer_tokens": 1},
    "dynamic_sampling": {K + "dynamic_sampling": True, K + "dynamic_sampling_max_rounds": 1},
    "entropy": {K + "entropy_coef": 0.1},
    "k3_full_logits": {
        K + "kl_coef": 0.1,
        K + "kl_estimator": "k3",
        "kernels.fused_lm_head": False,
    },
    # Clip-higher acts on positive-advantage tokens whose ratio rose past 1 + clip_low: two epochs
    # over the same 16 samples (the second optimizer step retrains what the first pushed up), with a
    # smaller step. Their ratios then reach ~1.28-1.35, so clip_high is 0.5 (DAPO's 0.28 would cut
    # through that cluster).
    "epochs": EPOCHS,
    "clip_high": {**EPOCHS, K + "clip_high": 0.5},
}


# options whose run records sampler log-probs moved by +-this (tests.option_runs.record_run): a
# sampler that differs
SAMPLER_SHIFTS = {"rollout_is_cap_shifted": 0.3}
# truncated sampling (grpo_ds.algo.truncation), each run with importance weights (which measure the
# replay)
TRUNCATED = {
    "top_k_3": {"rollout.top_k": 3},
    "top_p_0.5": {"rollout.top_k": 0, "rollout.top_p": 0.5},
    "top_k_5_top_p_0.7_t_0.7": {
        "rollout.top_k": 5,
        "rollout.top_p": 0.7,
        "rollout.temperature": 0.7,
    },
}
OPTIONS.update({name: {**keys, K + "rollout_is_cap": 2.0} for name, keys in TRUNCATED.items()})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(name): the recorded run of OPTIONS[name], trained once per module.

    Building a ZeRO-3 engine runs a full gc.collect() (DeepSpeed), which in a process holding torch
    and transformers costs ~0.4 s, most of a run here. The objects alive before the runs are frozen
    (left out of collections; garbage made during the runs is still collected) and unfrozen after
    the module."""
    model = save_test_model(tmp_path_factory.mktemp("model"))
    done = {}

    def get(name):
        if name not in done:
            done[name] = record_run(
                tmp_path_factory.mktemp("runs"),
                name,
                {"model.path": model, **OPTIONS[name]},
                SAMPLER_SHIFTS.get(name, 0.0),
            )
        return done[name]

    gc.freeze()
    yield get
    gc.unfreeze()


def _norm(x: torch.Tensor) -> float:
    return x.norm().item()


def matches_reference(run, step=1, index=0):
    """The driver's optimizer step is the reference math's; returns the reference."""
    opt, ref = run.at(step, index), run.reference(step, index)
    # advantages and token weights: the same float32 arithmetic on the same numbers (but a KL in the
    # reward is computed from the driver's log-prob kernels there and from full logits here: ~1e-6
    # apart, scaled by 1 / std)
    atol = 2e-5 if run.recipe.algorithm.kl_in_reward else 1e-6
    torch.testing.assert_close(torch.tensor(opt.data.advantages), ref.advantages, rtol=0, atol=atol)
    got = opt.token_weights()
    assert sorted(got) == sorted(opt.sample_ids)
    for i in opt.sample_ids:
        torch.testing.assert_close(got[i], ref.token_weights[i], rtol=1e-6, atol=1e-9)
    # loss statistics: fp32 sums in another order (kernels, chunks, micro-batches) differ by ~1e-7
    # relative
    for key in ("loss", "kl", "entropy", "clipped_tokens", "response_tokens"):
        assert getattr(opt.stats, key) == pytest.approx(
            getattr(ref.stats, key), rel=1e-5, abs=1e-6
        ), key
    # the weight change is AdamW's step on the reference gradient: to fp32 log-probs computed
    # another way (measured
    # <= 1.4e-5 of the step), plus the resolution of the fp32 weights it is read from
    error, size = _norm(opt.delta() - ref.update), _norm(ref.update)
    assert error < 1e-4 * size + opt.resolution(), (
        f"{run.recipe.run.name} {step}.{index}: {error:.1e} off {size:.1e}"
    )
    return ref


def acts(option, default, step=1, index=0, least=0.05):
    """The reference says the option changes this update by at least ``least`` of its norm, and the
    driver's weight change differs from the default's by that predicted change (to 1% of it:
    cosine > 0.9999)."""
    predicted = (
        matches_reference(option, step, index).update
        - matches_reference(default, step, index).update
    )
    measured = option.at(step, index).delta() - default.at(step, index).delta()
    size = _norm(predicted) / _norm(default.reference(step, index).update)
    assert size >= least, f"the reference predicts only a {size:.1e} relative change"
    off = _norm(measured - predicted) / _norm(predicted)
    assert off < 1e-2, f"measured change off the predicted one by {off:.1e} of it"


def same_update(option, default, step=1, index=0):
    """Where the option cannot act: the reference predicts the default's update, and the driver made
    it."""
    scale = _norm(default.reference(step, index).update)
    assert (
        _norm(matches_reference(option, step, index).update - default.reference(step, index).update)
        < 1e-5 * scale
    )
    difference = _norm(option.at(step, index).delta() - default.at(step, index).delta())
    assert difference < 1e-5 * scale + option.at(step, index).resolution()


def first_update_acts(runs, name):
    """The option draws the default's samples, and changes the first update of the rollout as
    predicted."""
    option, default = runs(name), runs("default")
    _same_samples(option, default)
    acts(option, default)
    return option, default


def second_update_acts(option, default):
    """An option that cannot act at the first optimizer step of the rollout: that update is the
    default's, and the second one changes as predicted."""
    same_update(option, default)
    acts(option, default, index=1)


def _same_samples(a, b, step=1):
    assert a.at(step).data.rollouts.response_ids == b.at(step).data.rollouts.response_ids
    assert a.at(step).data.rewards == b.at(step).data.rewards


def _groups(values, size=4):
    return [values[g : g + size] for g in range(0, len(values), size)]


# -------------------------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_default_run_is_the_reference_math(runs):
    default = runs("default")
    for opt in default.steps:
        matches_reference(default, opt.step, opt.index)
    assert len(default.metrics) == 2 and [m["optimizer_steps"] for m in default.metrics] == [2, 2]
    # the samples hold what the options below need: mixed lengths, EOS stops and length cuts,
    # unequal and equal reward groups
    data = default.at(1).data
    assert {len(r) for r in data.rollouts.response_ids} == {1, 2, 3}
    assert set(data.rollouts.finish_reason) == {"stop", "length"}
    assert {len(set(g)) for g in _groups(data.rewards)} == {1, 2}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "dr_grpo"])
def test_advantage_estimator_acts(runs, name):
    # with the estimator's advantages (matches_reference)
    option, default = first_update_acts(runs, name)
    mine, grpo = (
        torch.tensor(option.at(1).data.advantages),
        torch.tensor(default.at(1).data.advantages),
    )
    rewards = torch.tensor(default.at(1).data.rewards).view(-1, 4)
    centred = (rewards - rewards.mean(dim=1, keepdim=True)).view(-1)
    # r_j - mean of the other G - 1 = G / (G - 1) x (r_j - group mean), not scaled
    if name == "rloo":
        torch.testing.assert_close(mine, centred * 4 / 3)
    # r_j - group mean, not scaled; and every token weighs 1 / (N x max_new_tokens)
    if name == "dr_grpo":
        torch.testing.assert_close(mine, centred)
        weights = torch.cat(list(option.at(1).token_weights().values()))
        norm = len(option.at(1).sample_ids) * option.recipe.rollout.max_new_tokens
        torch.testing.assert_close(weights, torch.full_like(weights, 1 / norm))
    # batch baseline: equal-reward groups get a non-zero advantage (GRPO gives them 0)
    if name == "reinforce_pp":
        flat = [g for g, r in enumerate(_groups(default.at(1).data.rewards)) if len(set(r)) == 1]
        assert flat and all(
            grpo.view(-1, 4)[g].abs().max() == 0 < mine.view(-1, 4)[g].abs().min() for g in flat
        )
    assert (mine - grpo).abs().max() > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_aggregation_acts(runs, mode):
    option, default = first_update_acts(runs, mode)
    opt = option.at(1)
    n = len(opt.sample_ids)
    # token-mean: 1 / (all tokens); these modes: per sequence
    for weights in opt.token_weights().values():
        expected = 1 / (n * len(weights)) if mode == "seq-mean-token-mean" else 1 / n
        torch.testing.assert_close(weights, torch.full_like(weights, expected))


@pytest.mark.slow
def test_gspo_acts_from_the_second_optimizer_step(runs):
    # GSPO against PPO with the same aggregation and clip range. At ratio 1 GSPO's token gradient
    # s_i * grad log pi = grad log pi is PPO's: the first update is the same. At the second, a
    # sequence is clipped as a whole, by its length-normalised ratio s_i, and an unclipped one
    # weighs s_i instead of each token's own ratio.
    option, ppo = runs("gspo"), runs("seq-mean-token-mean")
    second_update_acts(option, ppo)
    mine, token_level = option.reference(1, 1), ppo.reference(1, 1)
    # GSPO clips every sequence as a whole; PPO clips only some tokens of a sequence here
    assert all(
        len(mine.clipped[mine.seq_index == s].unique()) == 1 for s in mine.seq_index.unique()
    )
    assert any(
        len(token_level.clipped[token_level.seq_index == s].unique()) == 2
        for s in mine.seq_index.unique()
    )


@pytest.mark.slow
def test_dual_clip_acts_from_the_second_optimizer_step(runs):
    # The dual clip bounds the loss of a negative-advantage token at -dual_clip * A once its ratio
    # exceeds dual_clip: not at ratio 1, but at the second optimizer step, where those tokens then
    # train nothing.
    option, default = runs("dual_clip"), runs("default")
    second_update_acts(option, default)
    ref = option.reference(1, 1)
    bound = (
        ((ref.token_advantage < 0) & (ref.ratio > option.recipe.algorithm.dual_clip)).sum().item()
    )
    assert (
        bound >= 1
        and option.at(1, 1).stats.clipped_tokens == default.at(1, 1).stats.clipped_tokens + bound
    )


@pytest.mark.slow
def test_clip_higher_acts_from_the_second_optimizer_step(runs):
    # A higher clip_high lets a positive-advantage token whose ratio is in (1 + 0.2, 1 + clip_high]
    # keep its gradient.
    option, default = runs("clip_high"), runs("epochs")
    second_update_acts(option, default)
    ref = default.reference(1, 1)
    low, high = 1 + default.recipe.algorithm.clip_high, 1 + option.recipe.algorithm.clip_high
    window = ((ref.token_advantage > 0) & (ref.ratio > low) & (ref.ratio <= high)).sum().item()
    assert (
        window >= 1
        and option.at(1, 1).stats.clipped_tokens == default.at(1, 1).stats.clipped_tokens - window
    )


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_loss_acts(runs, estimator):
    option, default = runs(estimator), runs("default")
    _same_samples(option, default)
    # At the first optimizer step the policy is the reference: every estimator's KL is 0. k2 = r^2 /
    # 2 and k3 = exp(r) - r - 1 have gradient 0 there too; k1 = log pi - log pi_ref has gradient
    # grad log pi.
    assert option.at(1, 0).stats.kl == pytest.approx(0.0, abs=1e-5)
    if estimator == "k1":
        acts(option, default)
    else:
        second_update_acts(option, default)
        assert option.at(1, 1).stats.kl > 1e-3  # the policy has left the reference


@pytest.mark.slow
def test_kl_in_the_reward_acts_from_the_second_rollout(runs):
    # The penalty -kl_coef * sum_t KL_t uses the sampling policy's log-probs: at the first rollout
    # that policy is the reference and the penalty is 0; at the second it shapes the rewards, hence
    # the advantages. The loss has no KL.
    option, default = runs("kl_in_reward"), runs("default")
    assert option.metrics[0]["reward/kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    same_update(option, default)
    same_update(option, default, index=1)
    _same_samples(option, default, step=2)  # the same policy sampled the second rollout
    acts(option, default, step=2)
    ref = option.reference(2)
    assert ref.penalties["kl"].abs().max() > 1e-2
    assert option.metrics[1]["reward/kl_penalty"] == pytest.approx(
        ref.penalties["kl"].mean().item(), rel=1e-5
    )
    assert (
        torch.tensor(option.at(2).data.advantages) - torch.tensor(default.at(2).data.advantages)
    ).abs().max() > 0.01
    assert all(o.stats.kl == 0.0 for o in option.steps)


@pytest.mark.slow
def test_rollout_importance_weights_are_one_at_staleness_zero(runs):
    # The sampler draws from the 50 most likely tokens (rollout.top_k), renormalised, and the
    # trainer scores every token over the same set (grpo_ds.algo.truncation): the weights min(pi_old
    # / pi_sampler, 2) are 1 to float32 rounding, and the update is the default's. Scored over the
    # whole vocabulary instead (what grpo_ds did before), each weight would be its position's mass
    # inside the set, M = Z_S / Z (trl#6789's closed form), which is well below 1 here: the test
    # shows that too, so it would have failed before the trainer replayed the set.
    option, default = runs("rollout_is_cap"), runs("default")
    _same_samples(option, default)
    same_update(option, default)
    metrics = option.metrics[0]
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    # float32 on both sides, the same forward up to packing
    assert metrics["sampler_logprob_gap_max"] <= 1e-6
    data, recipe = option.at(1).data, option.recipe
    rollouts = data.rollouts
    with torch.no_grad():
        model = policy_model(option.at(1).before)
        full = _full_vocabulary_logprobs_and_mass(
            model, data, recipe.rollout.temperature, recipe.rollout.top_k
        )
    for i, (logprob, mass) in enumerate(full):
        sampler = torch.tensor(rollouts.sampler_logprobs[i])
        torch.testing.assert_close((logprob - sampler).exp(), mass, rtol=2e-5, atol=0)
    masses = torch.cat([mass for _, mass in full])
    assert masses.max() < 1.0 and masses.mean() < 0.9


def _full_vocabulary_logprobs_and_mass(model, data, temperature, top_k):
    """Per sample: (the whole-vocabulary log-probs of its tokens, the probability mass of the top_k
    set around each), from one forward per sample."""
    out = []
    for prompt, response in zip(data.rollouts.prompt_ids, data.rollouts.response_ids, strict=True):
        # (L, V)
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        logprob = probs.log().gather(1, torch.tensor(response)[:, None]).squeeze(1)
        out.append((logprob, probs.topk(top_k, dim=-1).values.sum(dim=-1)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", TRUNCATED)
def test_truncated_sampling_is_replayed_at_every_optimizer_step(runs, name):
    """The sampler draws from the top-k / top-p set (the hf engine: transformers' warpers), and the
    driver's update is the reference math's over that set: the first optimizer step (the sampling
    policy, importance weights exactly 1: the trainer computes what the sampler sampled) and the
    second (PPO ratios of the truncated policy)."""
    run = runs(name)
    for index in (0, 1):
        matches_reference(run, 1, index)
    metrics = run.metrics[0]
    assert (
        1 - 1e-5
        <= metrics["is_weight_min"]
        <= metrics["is_weight_mean"]
        <= metrics["is_weight_max"]
        <= 1 + 1e-5
    )
    assert metrics["sampler_logprob_gap_max"] <= 1e-5
    settings = run.at(1).data.rollouts.sampler_settings
    assert {(s.temperature, s.top_k, s.top_p) for s in settings} == {
        (run.recipe.rollout.temperature, run.recipe.rollout.top_k, run.recipe.rollout.top_p)
    }


@pytest.mark.slow
def test_rollout_importance_weights_act(runs):
    # A sampler whose recorded log-probs are off the trainer's by -+0.3, token by token (what
    # staleness, vLLM or another precision make): every weight is exp(+-0.3), under the cap of 2,
    # and each token's loss is weighted by it.
    option, default = first_update_acts(runs, "rollout_is_cap_shifted")
    ref = option.reference(1)
    weights = torch.cat(list(ref.importance.values()))
    assert torch.allclose(weights.log().abs(), torch.tensor(0.3), atol=1e-5)
    metrics = option.metrics[0]
    assert metrics["is_truncated_frac"] == 0.0
    everyone = torch.cat(
        [option.reference(1).importance[i] for i in option.at(1).sample_ids]
        + [option.reference(1, 1).importance[i] for i in option.at(1, 1).sample_ids]
    )
    assert metrics["is_weight_mean"] == pytest.approx(everyone.mean().item(), rel=1e-5)


@pytest.mark.slow
def test_mask_truncated_acts(runs):
    # Samples cut by the length limit train nothing and leave the token-mean's denominator.
    option, default = first_update_acts(runs, "mask_truncated")
    opt = option.at(1)
    reasons = opt.data.rollouts.finish_reason
    stopped = sum(
        len(opt.data.rollouts.response_ids[i]) for i in opt.sample_ids if reasons[i] == "stop"
    )
    for i, weights in opt.token_weights().items():
        torch.testing.assert_close(
            weights, torch.full_like(weights, 0.0 if reasons[i] == "length" else 1 / stopped)
        )


@pytest.mark.slow
def test_overlong_penalty_acts(runs):
    # A buffer of 1 token before the 3-token limit: a 3-token completion loses 1.0 of reward,
    # shorter ones nothing.
    option, default = first_update_acts(runs, "overlong")
    data = option.at(1).data
    penalty = option.reference(1).penalties["overlong"]
    assert penalty.tolist() == [-1.0 if len(r) == 3 else 0.0 for r in data.rollouts.response_ids]
    assert option.metrics[0]["reward/overlong_penalty"] == pytest.approx(penalty.mean().item())


@pytest.mark.slow
def test_dynamic_sampling_acts(runs):
    # The first round draws the default's samples; its equal-reward groups (zero advantage) are
    # replaced by groups of a second round that have unequal rewards, then topped up with
    # equal-reward groups if too few.
    option, default = runs("dynamic_sampling"), runs("default")
    acts(option, default)
    # there is something to replace
    assert any(len(set(g)) == 1 for g in _groups(default.at(1).data.rewards))
    metrics = option.metrics[0]
    assert (metrics["dynamic/rounds"], metrics["dynamic/prompts_drawn"]) == (2, 8)
    default_groups = dict(
        zip(default.at(1).data.prompt_index, _groups(default.at(1).data.rewards), strict=True)
    )
    mine = dict(
        zip(option.at(1).data.prompt_index, _groups(option.at(1).data.rewards), strict=True)
    )
    kept = [p for p, rewards in default_groups.items() if len(set(rewards)) > 1]
    # every informative group of the first round stays
    assert all(mine[p] == default_groups[p] for p in kept)
    informative_now = sum(len(set(rewards)) > 1 for rewards in mine.values())
    assert informative_now == min(4, metrics["dynamic/informative_groups"]) > len(kept)
    assert metrics["dynamic/topped_up_groups"] == 4 - informative_now


@pytest.mark.slow
def test_entropy_bonus_acts(runs):
    # -entropy_coef * H_t adds -entropy_coef * grad H_t to the gradient; H itself is the default's
    # at that step.
    option, default = first_update_acts(runs, "entropy")
    assert option.at(1).stats.entropy == pytest.approx(default.at(1).stats.entropy, rel=1e-6)


@pytest.mark.slow
def test_full_logits_give_the_fused_update(runs):
    # kernels.fused_lm_head false computes the loss from full logits with the logits kernels
    # (log-probs, then the masked policy loss with its clip and KL terms) instead of the fused
    # lm_head kernels: the prediction for a kernel option is the same update, at every optimizer
    # step (the second one clips and has a KL).
    full, fused = runs("k3_full_logits"), runs("k3")
    assert [o.settings.loss.fused_lm_head for o in full.steps + fused.steps] == [
        False,
        False,
        True,
        True,
    ]
    for a, b in zip(full.steps, fused.steps, strict=True):
        matches_reference(full, a.step, a.index)
        assert _norm(a.delta() - b.delta()) < 1e-5 * _norm(b.delta())
        for key in ("loss", "kl", "entropy", "clipped_tokens"):
            assert getattr(a.stats, key) == pytest.approx(
                getattr(b.stats, key), rel=1e-5, abs=1e-6
            ), key
    assert fused.at(1, 1).stats.clipped_tokens > 0


def test_truncated_completions_get_no_weight():
    from grpo_ds.config.loading import load_recipe
    from grpo_ds.rollout.base import Rollouts
    from grpo_ds.step.update import UpdateSettings, trained_tokens

    rollouts = Rollouts(
        [[1], [1]], [[5, 6], [5, 1]], [[0.0, 0.0]] * 2, ["length", "stop"], [[1, 1], [1, 0]]
    )
    on = UpdateSettings.from_recipe(
        load_recipe({"algorithm": {"mask_truncated": True}}), 0, "torch"
    )
    off = UpdateSettings.from_recipe(load_recipe({}), 0, "torch")
    # truncated: out; loss mask counts
    assert [trained_tokens(rollouts, i, on) for i in range(2)] == [0, 1]
    assert [trained_tokens(rollouts, i, off) for i in range(2)] == [2, 1]


@pytest.mark.slow
def test_observability_peak_memory_and_sample_completions(tmp_path):
    import json

    metrics = grpo_ds.train(
        str(REPO / "recipes" / "tiny_cpu.json"),
        {
            "train.steps": 3,
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 4,
            "rollout.max_new_tokens": 3,
            "train.micro_batch_samples_per_gpu": 4,
            "logging.progress_bar": False,
            "run.output_dir": str(tmp_path),
            "run.name": "obs",
            "logging.samples_every_steps": 2,
            "logging.samples_per_log": 3,
        },
    )
    # resident memory of this process, GiB
    assert all(0.05 < m["peak_memory_gib"] < 64 for m in metrics)
    records = [
        json.loads(line) for line in (tmp_path / "obs" / "samples.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2]  # the first step, then every 2 steps
    first = records[0]["samples"]
    assert len(first) == 3 and all(set(s) == {"prompt", "completion", "reward"} for s in first)
    assert first[0]["prompt"].endswith("=")  # builtin:arith prompts such as "3+4="
