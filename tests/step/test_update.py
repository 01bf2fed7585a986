"""The loss contract and the phases of grpo_ds/step/update.py.

1. One optimizer step gives the same parameters (fp32, rtol 1e-5) for world size 1 with one
   micro-batch and world size 2 with uneven response lengths, several micro-batches and padding, for
   every loss_agg mode, with and without dynamic micro-batches (real `deepspeed` launcher, CPU); a
   mixture of experts too, at world sizes 2 and 3 with ranks routing to different experts, and its
   routers' load-balancing loss acts as grpo_ds/step/loss.py says.
2. Each phase uses its own micro size, and the old-log-prob pass runs exactly when it is needed.
"""

import importlib.util
import json

import pytest
import torch

import grpo_ds.model.policy as policy_module
import grpo_ds.step.update as update_module
import grpo_ds.train as train_module
from grpo_ds.algo.names import LOSS_AGG_MODES
from grpo_ds.algo.router import load_balancing_loss
from grpo_ds.model.tiny import build_tiny_model
from tests.launch import REPO, deepspeed_launch
from tests.scripts.one_step import VOCAB, fixed_rollouts

SCRIPT = str(REPO / "tests" / "scripts" / "one_step.py")


# world size 1's configs: every loss_agg mode in every layout, one micro-batch each
LAYOUTS = [
    {"packing": packing, "attn": attn} for packing in (True, False) for attn in ("sdpa", "eager")
]
SINGLE = [
    {"loss_agg": mode, "micro": 9, "max_tokens": None, **layout}
    for mode in LOSS_AGG_MODES
    for layout in LAYOUTS
]
# world size 2, data parallel: uneven shards, several micro-batches, padding, a token cap
SPLIT = [
    {"loss_agg": mode, "micro": micro, "max_tokens": cap, **layout}
    for mode in LOSS_AGG_MODES
    for micro, cap in ((2, None), (2, 40))
    for layout in LAYOUTS[:2]
]
SPLIT += [
    {"loss_agg": mode, "micro": 2, "max_tokens": None, **LAYOUTS[3]} for mode in LOSS_AGG_MODES
]
# The same step through full logits (logits kernels + masked policy loss) and, when Triton is
# installed, through the Triton kernels (the interpreter on CPU) with the lm_head weight a
# partitioned ZeRO-3 parameter.
SPLIT += [
    {"loss_agg": "seq-mean-token-mean", "micro": 2, "max_tokens": None, "fused_lm_head": False}
]
if importlib.util.find_spec("triton") is not None:
    SPLIT += [
        {"loss_agg": "seq-mean-token-mean", "micro": 2, "max_tokens": 40, "backend": "triton"},
        {
            "loss_agg": "token-mean",
            "micro": 2,
            "max_tokens": None,
            "backend": "triton",
            "fused_lm_head": False,
        },
    ]
# world size 2, tensor and sequence parallel (compared with world size 1's seq-mean-token-mean
# packed sdpa step)
TP_SP_BASE = {"loss_agg": "seq-mean-token-mean", "max_tokens": None}
TWO = [
    {**TP_SP_BASE, "micro": 2, "tp": 2, "stage": 1},
    {**TP_SP_BASE, "micro": 2, "tp": 2, "stage": 3},
    {**TP_SP_BASE, "micro": 2, "sp": 2},
    {**TP_SP_BASE, "micro": 3, "sp": 2, "fused_lm_head": False},
]
# A mixture of experts (grpo_ds.model.tiny: 16 experts a layer, top-2, so a micro-batch of two
# samples leaves some experts idle): world size 1's step, then the same with the routers'
# load-balancing loss at ROUTER_AUX; world size 2 with several micro-batches and a padding one, a
# token cap, the padded layout, sp=2 (Ulysses: each rank a slice of every sequence); world size 3.
MOE = {"loss_agg": "token-mean", "max_tokens": None, "experts": 16}
ROUTER_AUX = 0.5
MOE_SINGLE = [{**MOE, "micro": 9}, {**MOE, "micro": 9, "router_aux": ROUTER_AUX}]
MOE_SPLIT = [
    {**MOE, "micro": 2},
    {**MOE, "micro": 2, "max_tokens": 40},
    {**MOE, "micro": 2, "packing": False},
    {**MOE, "micro": 2, "sp": 2},
]
MOE_THREE = [{**MOE, "micro": 2}, {**MOE, "micro": 2, "max_tokens": 40}]
# Truncated sampling (grpo_ds.algo.truncation): the log-prob pass and the loss over the sampler's
# top-k / top-p set (the fixed rollouts' tokens mostly outside it: the sampled token is always
# kept). World size 1 without and with the set at the same temperature; world size 2 with a token
# cap, padded rows with eager attention, full logits, sp=2 and the Triton kernels (fused and full
# logits).
TRUNCATED = {"top_k": 5, "top_p": 0.7, "temperature": 0.7}
TRUNC_BASE = {"loss_agg": "seq-mean-token-mean", "max_tokens": None, "sampling": TRUNCATED}
TRUNC_SINGLE = [
    {**TRUNC_BASE, "micro": 9},
    {**TRUNC_BASE, "micro": 9, "sampling": {"temperature": 0.7}},
]
TRUNC_SPLIT = [
    {**TRUNC_BASE, "micro": 2, "max_tokens": 40},
    {**TRUNC_BASE, "micro": 2, **LAYOUTS[3]},
    {**TRUNC_BASE, "micro": 2, "fused_lm_head": False},
    {**TRUNC_BASE, "micro": 2, "sp": 2},
]
if importlib.util.find_spec("triton") is not None:
    TRUNC_SPLIT += [
        {**TRUNC_BASE, "micro": 2, "max_tokens": 40, "backend": "triton"},
        {**TRUNC_BASE, "micro": 2, "backend": "triton", "fused_lm_head": False},
    ]


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> dict[str, list[dict]]:
    """One launch per world size, shared by the layout tests: world size 1 runs SINGLE, MOE_SINGLE
    then TRUNC_SINGLE, world size 2 runs SPLIT, TWO, MOE_SPLIT then TRUNC_SPLIT (one process takes
    each config in turn, each with engines of its own). {"w1": [...], "w2": [...], "moe_w1": [...],
    "moe_w2": [...], "trunc_w1": [...], "trunc_w2": [...]}."""
    root = tmp_path_factory.mktemp("one_step")
    for name in ("w1", "w2"):
        (root / name).mkdir()
    parts = {"w1": (SINGLE, MOE_SINGLE, TRUNC_SINGLE), "w2": (SPLIT + TWO, MOE_SPLIT, TRUNC_SPLIT)}
    found = {}
    for world, (dense, moe, truncated) in parts.items():
        deepspeed_launch(
            int(world[1]), [SCRIPT, str(root / world), json.dumps(dense + moe + truncated)]
        )
        results = [
            torch.load(root / world / f"{i}.pt") for i in range(len(dense + moe + truncated))
        ]
        found.update(
            {
                world: results[: len(dense)],
                f"moe_{world}": results[len(dense) : len(dense + moe)],
                f"trunc_{world}": results[len(dense + moe) :],
            }
        )
    return found


@pytest.mark.slow
def test_one_optimizer_step_is_independent_of_the_parallel_layout(steps):
    """Every loss_agg mode, packed and padded micro-batches, sdpa and eager attention: the log-probs
    before the step and the weights after it equal world size 1's packed sdpa run with one
    micro-batch."""
    initial = dict(
        build_tiny_model(
            VOCAB, hidden_size=32, num_layers=2, num_heads=4, seed=0
        ).named_parameters()
    )
    runs = steps["w1"]
    baselines = runs[:: len(LAYOUTS)]  # per mode: packed, sdpa
    results = [(cfg, run) for cfg, run in zip(SINGLE, runs, strict=True)]
    results += list(zip(SPLIT, steps["w2"][: len(SPLIT)], strict=True))
    for cfg, result in results:
        base = baselines[LOSS_AGG_MODES.index(cfg["loss_agg"])]
        assert len(base["micro_batches"][0]) == 1  # world 1: one micro-batch
        if cfg["micro"] == 2:
            # world 2: several per rank
            assert all(len(rank) > 1 for rank in result["micro_batches"])
            if cfg["max_tokens"] is None:
                # 5 + 4 samples at 2 per micro-batch: one padding micro-batch
                assert result["padding"] >= 1
        for sample, logprobs in base["logprobs"].items():  # fp32 sums in another order: ~1e-7
            torch.testing.assert_close(result["logprobs"][sample], logprobs, rtol=0, atol=2e-6)
        for name, value in base["params"].items():
            # fp32 sums in another order differ by ~1e-7 relative; atol covers entries that are ~0
            torch.testing.assert_close(
                result["params"][name],
                value,
                rtol=1e-5,
                atol=1e-7,
                msg=lambda m, n=name, c=cfg: f"{c} {n}: {m}",
            )
    # The check is sensitive: the step moved the weights, and differently per mode (a wrong
    # normalisation would show as a different step, not as noise below the tolerance).
    moved = max(
        (baselines[0]["params"][n] - p.detach()).abs().max().item() for n, p in initial.items()
    )
    assert moved > 1e-3
    a, b = baselines[0]["params"], baselines[2]["params"]
    assert max((a[n] - b[n]).abs().max().item() for n in a) > 1e-4


@pytest.mark.slow
def test_a_truncated_sampler_step_is_independent_of_the_layout(steps):
    """With top-k and top-p the log-probs before the step and the weights after it, over the
    sampler's set, are world size 1's in every layout (each chunk and each sequence-parallel slice
    finds its rows' sets), and the set acts: the same step over the whole vocabulary, at the same
    temperature, scores and moves differently."""
    base, whole = steps["trunc_w1"]
    assert (
        max(
            (base["logprobs"][s] - whole["logprobs"][s]).abs().max().item()
            for s in base["logprobs"]
        )
        > 0.5
    )
    assert (
        max((base["params"][n] - whole["params"][n]).abs().max().item() for n in base["params"])
        > 1e-4
    )
    assert len(steps["trunc_w2"]) == len(TRUNC_SPLIT)
    for cfg, result in zip(TRUNC_SPLIT, steps["trunc_w2"], strict=True):
        for sample, logprobs in base["logprobs"].items():
            torch.testing.assert_close(
                result["logprobs"][sample],
                logprobs,
                rtol=0,
                atol=2e-6,
                msg=lambda m, c=cfg: f"{c}: {m}",
            )
        for name, value in base["params"].items():
            torch.testing.assert_close(
                result["params"][name],
                value,
                rtol=1e-5,
                atol=1e-7,
                msg=lambda m, n=name, c=cfg: f"{c} {n}: {m}",
            )


@pytest.mark.slow
def test_tensor_and_sequence_parallel_steps_equal_world_size_1(steps, tmp_path):
    """AutoTP: one optimizer step at tp=2 (ZeRO-1 and ZeRO-3) and at tp=2 x dp=2 (ZeRO-3, uneven
    shards and a padding micro-batch) gives the weights of world size 1, gathered over ZeRO and the
    tensor-parallel group to full shapes. Ulysses: at sp=2 (ZeRO-3; the fused lm_head and full
    logits) every sequence is split over the two ranks, and the log-probs before the step and the
    weights after it are world size 1's."""
    (tmp_path / "tp2dp2").mkdir()
    deepspeed_launch(
        4,
        [
            SCRIPT,
            str(tmp_path / "tp2dp2"),
            json.dumps([{**TP_SP_BASE, "micro": 2, "tp": 2, "stage": 3}]),
        ],
    )
    # world size 1's run of this config (packed, sdpa, one micro-batch of 9)
    baseline = steps["w1"][SINGLE.index({**TP_SP_BASE, "micro": 9, **LAYOUTS[0]})]
    initial = dict(
        build_tiny_model(
            VOCAB, hidden_size=32, num_layers=2, num_heads=4, seed=0
        ).named_parameters()
    )
    # moved
    assert (
        max((baseline["params"][n] - p.detach()).abs().max().item() for n, p in initial.items())
        > 1e-3
    )
    results = steps["w2"][len(SPLIT) :]
    assert len(results) == len(TWO)
    results.append(torch.load(tmp_path / "tp2dp2" / "0.pt"))
    # dp = 2: two shards, one padded
    assert len(results[-1]["micro_batches"]) == 2 and results[-1]["padding"] == 1
    for result in results:
        assert result["params"].keys() == baseline["params"].keys()
        for sample, logprobs in baseline["logprobs"].items():
            torch.testing.assert_close(result["logprobs"][sample], logprobs, rtol=0, atol=2e-6)
        for name, value in baseline["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_a_mixture_of_experts_step_is_independent_of_the_layout(steps, tmp_path):
    """The tiny mixture of experts at world sizes 2 and 3 (several micro-batches, padding ones, a
    token cap, packed and padded; at sp=2 too) gives world size 1's log-probs and weights, while in
    the same forward the ranks route their tokens to different experts: transformers holds a layer's
    experts as one fused tensor, so ZeRO-3 gathers all of them on every rank whatever the routing
    (no rank waits for a gather another rank skips: these runs finishing is the proof), and the
    experts and routers train."""
    deepspeed_launch(3, [SCRIPT, str(tmp_path), json.dumps(MOE_THREE)])
    baseline = steps["moe_w1"][0]
    initial = dict(
        build_tiny_model(
            VOCAB, hidden_size=32, num_layers=2, num_heads=4, seed=0, num_experts=16
        ).named_parameters()
    )
    for name in (
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.0.mlp.gate.weight",
    ):
        # experts, router train
        assert (baseline["params"][name] - initial[name].detach()).abs().max() > 1e-4, name
    results = steps["moe_w2"] + [torch.load(tmp_path / f"{i}.pt") for i in range(len(MOE_THREE))]
    uneven = 0
    for cfg, result in zip(MOE_SPLIT + MOE_THREE, results, strict=True):
        # two samples a micro-batch: several on every rank (a token cap may fit all)
        if cfg["max_tokens"] is None:
            assert all(len(rank) > 1 for rank in result["micro_batches"])
        for sample, logprobs in baseline["logprobs"].items():
            torch.testing.assert_close(result["logprobs"][sample], logprobs, rtol=0, atol=2e-6)
        for name, value in baseline["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-7)
        routing = result["routing"]  # [rank][forward][layer] the experts its tokens went to
        assert len({len(forwards) for forwards in routing}) == 1  # every rank ran the same forwards
        for forward in zip(*routing, strict=True):
            for layer in zip(*forward, strict=True):
                uneven += len(set.union(*layer) - set.intersection(*layer)) > 0
    # forwards and layers where an expert got tokens on one rank and none on another
    assert uneven >= 10


@pytest.mark.slow
def test_the_routers_load_balancing_loss_adds_its_gradient(steps):
    """model.router_aux_loss_coef acts as grpo_ds/step/loss.py says: at world size 1 with one
    micro-batch of token-mean weights (they sum to 1), the step with it moves the weights by
    ROUTER_AUX x the gradient of L_aux more than the step without it (one_step.py's optimizer makes
    a plain gradient step, lr / eps = 1), L_aux computed here on a plain model over the padded
    samples (grpo_ds.algo.router; the driver packs them and leaves rows' ends out)."""
    rollouts, _ = fixed_rollouts()
    sequences = [p + r for p, r in zip(rollouts.prompt_ids, rollouts.response_ids, strict=True)]
    width = max(len(s) for s in sequences)
    input_ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    model = build_tiny_model(
        VOCAB, hidden_size=32, num_layers=2, num_heads=4, seed=0, num_experts=16
    )
    out = model(
        input_ids=input_ids, attention_mask=mask, output_router_logits=True, use_cache=False
    )
    load_balancing_loss(out.router_logits, 2, mask).backward()
    without, with_aux = (run["params"] for run in steps["moe_w1"])
    names = [name for name, p in model.named_parameters() if p.grad is not None]
    predicted = torch.cat(
        [-ROUTER_AUX * dict(model.named_parameters())[n].grad.reshape(-1) for n in names]
    )
    measured = torch.cat([(with_aux[n] - without[n]).reshape(-1) for n in names])
    update = torch.cat(
        [(without[n] - p.detach()).reshape(-1) for n, p in model.named_parameters() if n in names]
    )
    assert predicted.norm() > 0.05 * update.norm()  # a good part of the step: the test can see it
    assert (measured - predicted).norm() < 1e-2 * predicted.norm()
    # the last layer's experts: after its router
    untouched = [n for n, p in model.named_parameters() if p.grad is None]
    assert untouched and all(torch.equal(with_aux[n], without[n]) for n in untouched)


class _Recorder:
    """Records (phase, grad enabled, sequences) of every micro-batch forward: the engines' forward
    hook reads how many sequences the micro-batch it runs was collated from (packed rows hold
    several)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, bool, int]] = []
        self.engines: dict = {}
        self._collated: list = []
        for factory, label in (
            ("create_train_engine", "policy"),
            ("create_reference_engine", "reference"),
        ):
            real = getattr(policy_module, factory)
            monkeypatch.setattr(policy_module, factory, self._wrap(real, label))
        real_collate = update_module.collate

        def collate(*args, **kwargs):
            mb = real_collate(*args, **kwargs)
            self._collated.append(mb)
            return mb

        monkeypatch.setattr(update_module, "collate", collate)

    def _wrap(self, real, label):
        def factory(model, ds_config, *args):
            engine = real(model, ds_config, *args)
            self.engines[label] = engine
            engine.module.register_forward_pre_hook(
                lambda _m, _a, kw: self._record(label, kw), with_kwargs=True
            )
            return engine

        return factory

    def _record(self, label, kwargs):
        """A forward of the last collated micro-batch's tensors; other forwards (the start-up
        packing probe) are not micro-batches."""
        mb = self._collated[-1] if self._collated else None
        if mb is not None and kwargs.get("input_ids") is mb.input_ids:
            self.calls.append((label, torch.is_grad_enabled(), mb.num_sequences))

    def sizes(self, label: str, grad: bool) -> list[int]:
        return [n for lab, g, n in self.calls if lab == label and g == grad]


def _run(tmp_path, **overrides):
    base = {
        "run.output_dir": str(tmp_path),
        "run.name": "phases",
        "run.overwrite": True,
        "train.steps": 1,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "train.micro_batch_samples_per_gpu": 2,
        "train.logprob_micro_batch_samples_per_gpu": 8,
        "logging.progress_bar": False,
    }
    base.update(overrides)
    return train_module.run(str(REPO / "recipes" / "tiny_cpu.json"), base)


@pytest.mark.slow
def test_old_logprob_pass_is_skipped_with_one_optimizer_step(tmp_path, monkeypatch):
    rec = _Recorder(monkeypatch)
    _run(tmp_path)
    assert rec.sizes("policy", grad=False) == []  # old log-probs = current ones, no extra pass
    assert rec.sizes("policy", grad=True) == [2] * 8  # 16 samples, update micro size 2
    assert rec.sizes("reference", grad=False) == []  # kl_coef 0: no reference model


@pytest.mark.slow
def test_each_phase_uses_its_own_micro_size(tmp_path, monkeypatch):
    rec = _Recorder(monkeypatch)
    # ZeRO-3 kept on one rank, for its reference engine (the stage-1 reference runs in the pinned
    # tests of test_train)
    metrics = _run(
        tmp_path,
        **{
            "train.samples_per_optimizer_step": 8,
            "algorithm.kl_coef": 0.1,
            "train.zero3_on_one_rank": True,
        },
    )
    assert metrics[0]["optimizer_steps"] == 2
    assert rec.sizes("policy", grad=False) == [8, 8]  # old-log-prob pass: log-prob micro size
    assert rec.sizes("reference", grad=False) == [8, 8]  # reference pass: log-prob micro size
    # update: 2 optimizer steps x 4 micro-batches of 2
    assert rec.sizes("policy", grad=True) == [2] * 8
    reference = rec.engines["reference"]
    # ZeRO-3 parameter manager, no optimizer
    assert type(reference.optimizer).__name__ == "DeepSpeedZeRoOffload"
    params = list(reference.module.parameters())
    # frozen, ZeRO-3 partitioned
    assert all(hasattr(p, "ds_id") and not p.requires_grad for p in params)


@pytest.mark.slow
def test_epochs_need_the_old_logprob_pass(tmp_path, monkeypatch):
    rec = _Recorder(monkeypatch)
    metrics = _run(tmp_path, **{"train.epochs_per_rollout": 2})
    assert metrics[0]["optimizer_steps"] == 2
    assert rec.sizes("policy", grad=False) == [8, 8]
    assert rec.sizes("policy", grad=True) == [2] * 16


@pytest.mark.slow
def test_dynamic_micro_batches_apply_to_every_phase(tmp_path, monkeypatch):
    rec = _Recorder(monkeypatch)
    # tiny prompts are 4 tokens, completions 1-2: sequences of 5-6 tokens; cap 12 -> 2 per
    # micro-batch
    _run(
        tmp_path,
        **{
            "train.samples_per_optimizer_step": 8,
            "train.max_tokens_per_micro_batch": 12,
            "data.max_prompt_tokens": 8,
        },
    )
    for grad in (False, True):
        sizes = rec.sizes("policy", grad=grad)
        assert sizes and all(n <= 2 for n in sizes)
