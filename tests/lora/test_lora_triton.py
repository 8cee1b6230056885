"""The LoRA projection through the Triton kernels (Triton's interpreter on the CPU, compiled on a GPU): rows keep
their bits whatever the number of rows, the result and the adapters' gradients agree with a float64 reference,
and the frozen base weight gets no gradient."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernel modules
pytest.importorskip("triton")

from exactrl.model.lora import LoRA  # noqa: E402
from exactrl.model.qwen import PackedLinear  # noqa: E402
from exactrl.ops.triton import common  # noqa: E402
from exactrl.ops.triton_ops import TritonOps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if (
    DEVICE == "cpu" and not common.INTERPRET
):  # pragma: no cover - only when another module imported them first
    pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1", allow_module_level=True)


def _projection(dtype, rank=4):
    """A packed q/k/v-like projection (K = 64, parts 32/16/16) with adapters on parts 0 and 2."""
    g = torch.Generator().manual_seed(0)
    proj = PackedLinear(64, {"q_proj": 32, "k_proj": 16, "v_proj": 16})
    with torch.no_grad():
        proj.weight.copy_(torch.randn(64, 64, generator=g) * 0.1)
    proj.requires_grad_(False)
    lora = LoRA(64, [32, 16, 16], [(0, "q"), (2, "v")], rank, 2.0, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        lora.lora_A.copy_(torch.randn(lora.lora_A.shape, generator=g) * 0.1)
        for i in (0, 2):
            lora.B(i).copy_(torch.randn(lora.B(i).shape, generator=g) * 0.1)
    proj.lora = lora
    return proj.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_batch_invariant_and_match_float64(dtype):
    ops = TritonOps()
    proj = _projection(dtype)
    x = (torch.randn(40, 64, generator=torch.Generator().manual_seed(1)) * 0.5).to(DEVICE, dtype)
    with torch.no_grad():
        full = torch.cat(proj(ops, x), -1)
        for m in (1, 3, 17):
            assert torch.equal(torch.cat(proj(ops, x[:m]), -1), full[:m]), m
    # float64 reference of y = x W^T + s (x A_i^T) B_i^T per part
    xd, w = x.double().cpu(), proj.weight.double().cpu()
    lora = proj.lora
    ref = list((xd @ w.T).split([32, 16, 16], -1))
    for j, (i, _) in enumerate(lora.targets):
        ref[i] = ref[i] + 2.0 * (xd @ lora.part_A(j).double().cpu().T) @ lora.B(i).double().cpu().T
    err = float((full.double().cpu() - torch.cat(ref, -1)).abs().max())
    assert err < (1e-5 if dtype == torch.float32 else 3e-2), err
    # The adapters do something (negative control for the reference comparison).
    assert float((torch.cat(ref, -1) - xd @ w.T).abs().max()) > 10 * err


def test_adapter_gradients_and_a_frozen_base():
    ops = TritonOps()
    proj = _projection(torch.float32)
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE).requires_grad_(True)
    outs = proj(ops, x)
    loss = sum((o * (k + 1)).square().sum() for k, o in enumerate(outs))
    loss.backward()
    assert proj.weight.grad is None  # frozen: never a gradient, no dW GEMM
    # Reference: the same math in float64 through autograd.
    lora = proj.lora
    A = lora.lora_A.detach().double().cpu().requires_grad_(True)
    Bs = {i: lora.B(i).detach().double().cpu().requires_grad_(True) for i, _ in lora.targets}
    xd = x.detach().double().cpu().requires_grad_(True)
    parts = list((xd @ proj.weight.double().cpu().T).split([32, 16, 16], -1))
    for j, (i, _) in enumerate(lora.targets):
        parts[i] = parts[i] + 2.0 * (xd @ A[j * 4 : (j + 1) * 4].T) @ Bs[i].T
    sum((o * (k + 1)).square().sum() for k, o in enumerate(parts)).backward()
    for got, want in [(lora.lora_A.grad, A.grad), (x.grad, xd.grad)] + [
        (lora.B(i).grad, Bs[i].grad) for i in Bs
    ]:
        rel = float((got.double().cpu() - want).norm() / want.norm())
        assert rel < 1e-5, rel
