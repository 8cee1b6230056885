"""Two numerics that once escaped: bf16 RMSNorm with a non-unit weight must have transformers' bits (normalise in
fp32, cast to bf16, then multiply by the weight), and the RoPE table stays fp32 in a bf16 model."""

import pytest
import torch

from exactrl.model.config import preset
from exactrl.model.qwen import build_model
from exactrl.ops import get_ops

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402


@pytest.mark.parametrize("dim,rows", [(128, 37), (32, 300)])
def test_bf16_rms_norm_with_random_weight_is_hf_bitwise(dim, rows):
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(rows, dim, generator=g) * 3).bfloat16()
    w = (1 + 0.5 * torch.randn(dim, generator=g)).bfloat16()  # non-unit: a unit weight hides the cast order
    hf = Qwen3RMSNorm(dim, eps=1e-6).bfloat16()
    with torch.no_grad():
        hf.weight.copy_(w)
        want = hf(x)
    ops = get_ops("cpu", exact=True)
    got = ops.rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    # The fused residual add + norm gives the same bits as HF's `residual + x` then norm.
    r = (torch.randn(rows, dim, generator=g)).bfloat16()
    normed, summed = ops.add_rms_norm(x, r, w, 1e-6)
    with torch.no_grad():
        assert torch.equal(summed, x + r) and torch.equal(normed, hf(x + r))
    # Negative control: the other cast order (weight multiplied in fp32, then one cast) differs somewhere.
    xf = x.float()
    wrong = (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))).bfloat16()
    assert not torch.equal(wrong, want)


def test_rope_table_is_fp32_in_a_bf16_model():
    fp32 = build_model(preset("tiny", num_layers=1), dtype=torch.float32)
    bf16 = build_model(preset("tiny", num_layers=1), dtype=torch.bfloat16)
    table = bf16.rope_table(torch.device("cpu"))
    assert bf16.dtype == torch.bfloat16 and table.dtype == torch.float32
    assert torch.equal(table, fp32.rope_table(torch.device("cpu")))
    # Negative control: a table rounded to the model dtype loses bits the fp32 one has.
    assert not torch.equal(table.bfloat16().float(), table)
