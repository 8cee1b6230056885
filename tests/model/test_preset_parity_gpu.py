"""The preset sweep on the GPU (marker `gpu`): every preset's architecture at a small shape, float32 and bfloat16,
through the Triton exact ops and the engine's CUDA-graph decode, engine logprobs equal to the trainer's; and the
elementwise `sigmoid` (Qwen2-MoE's shared-expert gate) row-invariant at many row counts and widths on the device."""

from __future__ import annotations

import pytest
import torch
from preset_shapes import small_shape, trained_looking

from exactrl.model.config import PRESETS
from exactrl.ops import get_ops, set_exact_environment
from exactrl.parity import run_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MS = [1, 2, 3, 5, 7, 8, 15, 16, 17, 64, 255, 256, 300, 1000, 4097]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("width", [1, 37, 3072])
def test_sigmoid_rows_invariant_on_the_gpu(width, dtype):
    ops = get_ops("cuda", exact=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (4 * torch.randn(max(MS), width, device="cuda", generator=g)).to(dtype)
    full = ops.sigmoid(x)
    for m in MS:
        assert torch.equal(ops.sigmoid(x[:m]), full[:m]), m
        assert torch.equal(ops.sigmoid(x[m:]), full[m:]), (
            m
        )  # another start: other alignment, other vector loads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_exact_on_the_gpu(name, dtype):
    set_exact_environment(True)
    model = trained_looking(small_shape(PRESETS[name]), dtype)
    model = model.to("cuda")
    model.set_ops(get_ops("cuda", exact=True))
    res = run_parity(model, num_prompts=6, max_tokens=24, samples_per_prompt=3)
    assert res.tokens_identical_across_compositions
    assert res.num_mismatched == 0, f"{name} {dtype}: {res.num_mismatched} of {res.num_tokens} differ"
