"""The `[lora]` section: defaults, validation with the key named, and building adapters from it."""

import pytest
import torch
from lora_helpers import tiny

from exactrl import config as config_mod
from exactrl.config import ConfigError, config_from_dict
from exactrl.model import lora


def _cfg(**lora_keys):
    c = config_from_dict({"model": {"preset": "tiny"}, "lora": lora_keys}, source="run.toml")
    c.validate()
    return c


def test_defaults_are_off_and_all_linear():
    c = _cfg()
    assert c.lora.rank == 0
    assert tuple(c.lora.target_modules) == lora.LORA_TARGETS == config_mod.LORA_TARGETS
    assert lora.apply_lora_config(tiny(), c.lora) is None


@pytest.mark.parametrize(
    "keys, where, text",
    [
        ({"rank": -1}, "lora.rank", "must be >= 0"),
        ({"rank": 8, "alpha": 0.0}, "lora.alpha", "must be > 0"),
        ({"rank": 8, "target_modules": []}, "lora.target_modules", "at least one"),
        (
            {"rank": 8, "target_modules": ["q_proj", "qproj"]},
            "lora.target_modules[1]",
            "did you mean 'q_proj'",
        ),
        ({"rank": 8, "target_modules": ["q_proj", "q_proj"]}, "lora.target_modules", "twice"),
        ({"rank": 8, "dropout": 0.05}, "lora.dropout", "bitwise"),
        ({"rank": 0, "path": "adapters"}, "lora.path", "rank is 0"),
    ],
)
def test_bad_values_name_the_key(keys, where, text):
    with pytest.raises(ConfigError, match=text) as e:
        _cfg(**keys)
    assert e.value.key == where


def test_unimplemented_init_and_unknown_keys_are_refused():
    with pytest.raises(ConfigError, match="lora.init: expected one of 'default', 'gaussian'"):
        _cfg(rank=8, init="pissa")
    with pytest.raises(ConfigError, match="did you mean 'lora.rank'"):
        _cfg(rnk=8)


def test_config_builds_the_adapters(tmp_path):
    c = _cfg(rank=4, alpha=8.0, target_modules=["v_proj", "down_proj"], init="gaussian", rslora=True)
    model = tiny(torch.bfloat16)
    spec = lora.apply_lora_config(model, c.lora, seed=3)
    assert spec.scale == 8.0 / 2.0 and spec.init == "gaussian"
    params = lora.adapter_parameters(model)
    assert len(params) == 2 * 4 and all(p.dtype == torch.bfloat16 for p in params)
    assert lora.lora_num_params(model.config, spec) == sum(p.numel() for p in params)
    # A starts N(0, 1/r) (std 1/4 here), B at zero.
    a = model.model.layers[0].mlp.down_proj.lora.lora_A.float()
    assert 0.2 < float(a.detach().std()) < 0.3
    assert all(float(m.B(i).abs().sum()) == 0 for m in lora.lora_modules(model) for i, _ in m.targets)
    # Starting from a saved adapter: its targets must match the section's.
    lora.save_adapter(model, tmp_path / "a")
    c2 = _cfg(
        rank=4, alpha=8.0, target_modules=["v_proj", "down_proj"], rslora=True, path=str(tmp_path / "a")
    )
    again = tiny(torch.bfloat16)
    lora.apply_lora_config(again, c2.lora)
    assert all(torch.equal(x, y) for x, y in zip(params, lora.adapter_parameters(again)))
    c3 = _cfg(rank=4, alpha=8.0, target_modules=["v_proj"], rslora=True, path=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="missing|targets"):
        lora.apply_lora_config(tiny(torch.bfloat16), c3.lora)
