"""MoE parity on the GPU (marker `gpu`): the tiny Qwen3-MoE and Qwen2-MoE presets on cuda in bf16 through the
Triton exact ops (grouped expert GEMMs, the device-side routing plan) and the engine's CUDA-graph decode, whose
graphs replay with whatever routing each step brings. Engine logprobs equal the trainer's bit for bit under
preemption, prefix sharing and several batch compositions; fast mode (cuBLAS, FlashAttention, `torch._grouped_mm`
experts) is the negative control, so the comparison can fail."""

from __future__ import annotations

import pytest
import torch

from exactrl.model import build_model, preset
from exactrl.model.moe import SparseMoeBlock
from exactrl.ops import set_exact_environment
from exactrl.parity import run_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model(name: str, exact: bool):
    model = build_model(preset(name), device="cuda", dtype=torch.bfloat16, exact=exact, seed=0)
    with torch.no_grad():  # a confident router, as trained ones are: tokens spread unevenly over the experts
        for layer in model.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.gate.weight.mul_(8.0)
    return model


def _parity(model):
    return run_parity(
        model,
        num_prompts=8,
        max_tokens=48,
        temperature=0.8,
        seed=1,
        samples_per_prompt=4,
        kv_blocks=24,
        prefill_chunk=32,
        prompt_vocab=259,
    )


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-qwen2-moe"])
def test_moe_parity_exact_on_the_gpu(name: str) -> None:
    set_exact_environment(True)
    r = _parity(_model(name, exact=True))
    assert r.preemptions > 0 and r.fork_shared_blocks > 0, "the run must exercise preemption and sharing"
    assert r.num_tokens > 0 and r.num_mismatched == 0 and r.max_abs_diff == 0.0
    assert r.tokens_identical_across_compositions


def test_moe_parity_fast_mode_negative_control_on_the_gpu() -> None:
    set_exact_environment(False)
    try:
        r = _parity(_model("tiny-moe", exact=False))
    finally:
        set_exact_environment(True)
    assert r.num_mismatched > 0 or not r.tokens_identical_across_compositions
