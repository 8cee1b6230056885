"""`model.precision = "fp8"` on the CPU: the engine's recorded logprobs equal the trainer's forward bit for bit
(`run_parity`: four batch compositions, preemption, forks, prefix hits, three microbatch sizes) on the tiny and
tiny-moe presets, and a trainer that computes its projections in the model dtype differs (negative control)."""

from __future__ import annotations

import copy

import pytest
import torch
from preset_shapes import trained_looking

from exactrl.model.config import PRESETS
from exactrl.model.precision import apply_precision
from exactrl.model.qwen import build_model
from exactrl.ops.batch import AttentionBatch
from exactrl.ops.fp8 import Fp8Ops
from exactrl.parity import run_parity

KW = dict(num_prompts=2, max_tokens=6, samples_per_prompt=2, microbatch_tokens=(64, 1 << 30))


def _fp8_model(name: str, dtype: torch.dtype):
    return apply_precision(trained_looking(PRESETS[name], dtype), "fp8")


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_fp8_engine_matches_trainer(name):
    model = _fp8_model(name, torch.bfloat16)
    assert isinstance(model.ops, Fp8Ops)
    # every projection but the LM head (tied: the embedding) and the router is fp8
    cfg = model.config
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert (
        model.ops.num_weights == 2 * cfg.num_layers + 2 * cfg.num_layers
    )  # qkv, o; gate_up, down or experts
    assert moe_layers == (3 if name == "tiny-moe" else 0)
    res = run_parity(model, **KW)
    assert res.num_tokens > 30
    assert res.tokens_identical_across_compositions
    assert res.num_mismatched == 0, f"{name} fp8: {res.num_mismatched} of {res.num_tokens} logprobs differ"

    # negative control: the same weights scored by a trainer whose projections run in the model dtype
    plain = build_model(model.config, dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    bad = run_parity(
        model, scorer=plain, num_prompts=1, max_tokens=6, samples_per_prompt=1, microbatch_tokens=(64,)
    )
    assert bad.num_mismatched > bad.num_tokens // 2


def test_fp8_changes_the_numbers_and_stays_close():
    """fp8 is another function than the model dtype (the recipe ran), close to it at the init's scale (the recipe
    is right; trained_looking's weights are large enough for 4 layers to amplify any rounding)."""
    model = apply_precision(build_model(PRESETS["tiny"]), "fp8")
    plain = copy.deepcopy(model)
    plain.set_ops(model.ops.inner)
    ids = torch.arange(40) % model.config.vocab_size
    batch, pos = AttentionBatch.packed([40]), torch.arange(40)
    a, b = model(ids, pos, batch), plain(ids, pos, batch)
    assert not torch.equal(a, b)
    assert (a - b).norm() / b.norm() < 0.1


def test_deepcopy_keeps_fp8_on_the_copy():
    """The reference policy (a deep copy) runs fp8 on its own weights, not on the policy's."""
    model = _fp8_model("tiny", torch.float32)
    ref = copy.deepcopy(model)
    assert isinstance(ref.ops, Fp8Ops) and ref.ops is not model.ops
    assert ref.ops.num_weights == model.ops.num_weights
    w = ref.model.layers[0].self_attn.o_proj.weight
    assert ref.ops._entry(w) is not None and model.ops._entry(w) is None
