"""MasterAdamW's one-launch Triton step on a CUDA GPU (marker `gpu`): close to torch's fused AdamW, and a resume
from its state dict is bitwise the uninterrupted run."""

from __future__ import annotations

import io

import pytest
import torch

from exactrl.model import build_model, preset
from exactrl.train.optim import MasterAdamW

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model():
    return build_model(preset("tiny", num_layers=2), device="cuda", dtype=torch.bfloat16, seed=0)


def _grads(opt: MasterAdamW, step: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    for p in opt.params:
        scale = 40.0 if step == 1 else 1.0  # step 1 is clipped
        p.grad = (torch.randn(p.shape, generator=g, device="cuda") * scale).to(p.dtype)


def _snapshot(opt: MasterAdamW) -> list[torch.Tensor]:
    st = opt.opt.state
    return [
        t.clone()
        for m, p in zip(opt.master, opt.params)
        for t in (m.detach(), p.detach(), st[m]["exp_avg"], st[m]["exp_avg_sq"], st[m]["step"])
    ]


def test_triton_step_is_used_and_close_to_torch_fused():
    a_model, b_model = _model(), _model()
    a = MasterAdamW(a_model, lr=1e-3, weight_decay=0.1)
    b = MasterAdamW(b_model, lr=1e-3, weight_decay=0.1)
    b._triton_ready = lambda: False  # torch's fused AdamW with fp32 gradient copies
    for step in range(3):
        _grads(a, step)
        _grads(b, step)
        assert a._triton_ready()
        na, nb = a.clip_and_step(1.0), b.clip_and_step(1.0)
        assert abs(na - nb) <= 1e-6 * nb
    assert a._tables is not None
    for x, y in zip(_snapshot(a), _snapshot(b)):
        # fp32 state: close; bf16 weights: the rounding of two close masters may land one bf16 step apart.
        rtol = 2**-7 if x.dtype == torch.bfloat16 else 1e-4
        assert torch.allclose(x.float(), y.float(), rtol=rtol, atol=1e-6)
    # The weights moved at all (the comparison above is not between two untouched models).
    assert not torch.equal(a.params[0], _model().model.embed_tokens.weight)


def test_triton_step_resumes_bitwise():
    full = MasterAdamW(_model(), lr=1e-3, weight_decay=0.1)
    for step in range(3):
        _grads(full, step)
        full.clip_and_step(1.0)
    half_model = _model()
    half = MasterAdamW(half_model, lr=1e-3, weight_decay=0.1)
    for step in range(2):
        _grads(half, step)
        half.clip_and_step(1.0)
    buf = io.BytesIO()
    torch.save(half.state_dict(), buf)
    weights = {k: v.clone() for k, v in half_model.state_dict().items()}
    resumed_model = _model()
    resumed_model.load_state_dict(weights)
    resumed = MasterAdamW(resumed_model, lr=1e-3, weight_decay=0.1)
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), map_location="cpu", weights_only=True))
    _grads(resumed, 2)
    resumed.clip_and_step(1.0)
    for x, y in zip(_snapshot(full), _snapshot(resumed)):
        assert torch.equal(x, y)
    # Negative control: a different last gradient shows in the comparison.
    _grads(half, 7)
    half.clip_and_step(1.0)
    assert not all(torch.equal(x, y) for x, y in zip(_snapshot(full), _snapshot(half)))
