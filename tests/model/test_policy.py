"""The policy's models (grpo_ds.model.policy.Policy.build): the KL reference is a second load of
model.path, so its weight files are the policy's, checked with them before anything loads
(tests/model/test_loading.py); a file damaged between the two loads is named in one line by the
reference's load as well."""

import shutil

import pytest

from grpo_ds.config.deepspeed import resolve_deepspeed_config
from grpo_ds.config.loading import load_recipe
from grpo_ds.distributed.ranks import init_distributed
from grpo_ds.errors import UserError
from grpo_ds.model import policy as policy_module
from grpo_ds.model.policy import Policy
from grpo_ds.model.tiny import build_tiny_model, build_tiny_tokenizer


def test_the_reference_models_load_names_a_weights_file_cut_short(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    weights = folder / "model.safetensors"
    loads = []

    def load_then_cut(*args, **kwargs):
        """The policy's load, then its file cut to half (written beside and moved over it: the
        loaded policy maps the old file, which a cut in place would pull from under it)."""
        model = load_model(*args, **kwargs)
        loads.append(args[0].path)
        cut = tmp_path / "cut"
        cut.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        shutil.move(cut, weights)
        return model

    load_model = policy_module.load_model
    monkeypatch.setattr(policy_module, "load_model", load_then_cut)
    init_distributed()
    recipe = load_recipe({"model": {"path": str(folder)}, "algorithm": {"kl_coef": 0.1}})
    with pytest.raises(UserError) as err:
        Policy.build(recipe, resolve_deepspeed_config(recipe, 1, "cpu"), 0, announce=False)
    assert loads == [str(folder)]  # the policy loaded; the reference's load of model.path failed
    assert err.value.where == "model.path" and "\n" not in str(err.value)
    assert err.value.what.startswith(f"{weights} is cut short: ")
