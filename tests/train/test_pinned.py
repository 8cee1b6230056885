"""Exact-size page-locked host buffers for optimizer offload (exactrl/train/pinned.py).

On the CPU a stand-in for the CUDA runtime records what would be registered: exactly each tensor's bytes, in place,
dropped when the tensor goes, and a failure named. On a GPU (marked gpu) the optimizer's real offload buffers are
page-locked, exactly their size (not a power of two), the host-made masters locked in place, and a run with offload
keeps the bits of one without."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from exactrl.model.config import preset
from exactrl.model.qwen import build_model
from exactrl.train import pinned
from exactrl.train.optim import MasterAdamW


class FakeCudart:
    def __init__(self, fail: int = 0) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (the runtime's name)
        if self.fail:
            return self.fail
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def fake(monkeypatch) -> FakeCudart:
    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return rt


def test_exact_bytes_in_place_and_dropped_with_the_tensor(fake):
    t = torch.randn(3, 1000)  # 12,000 bytes: a power-of-two allocator would take 16,384
    before = t.clone()
    out = pinned.register(t)
    assert out is t and fake.registered == {t.data_ptr(): 12_000}
    assert torch.equal(t, before)  # in place: the values stay
    e = pinned.empty_pinned((5, 7), torch.float64)
    assert fake.registered[e.data_ptr()] == 5 * 7 * 8
    ptr = t.data_ptr()
    del t, out
    gc.collect()
    assert ptr in fake.unregistered and e.data_ptr() not in fake.unregistered


def test_a_refused_registration_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(fail=2))
    with pytest.raises(RuntimeError, match=r"page-locking 4000 bytes .*cudaHostRegister error 2.*ulimit -l"):
        pinned.register(torch.zeros(1000))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(fail=712))
    with pytest.raises(RuntimeError, match=r"page-locked already \(cudaHostRegister error 712\)"):
        pinned.register(torch.zeros(1000))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        pinned.register(torch.zeros(10, 10).t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_buffers_are_page_locked_exactly_and_keep_the_bits():
    torch.manual_seed(0)
    base = build_model(preset("tiny"), dtype=torch.bfloat16, device="cuda")
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    on = MasterAdamW(a, lr=1e-3, offload="optimizer")
    off = MasterAdamW(b, lr=1e-3)
    cpu_masters = [m.data_ptr() for m in on.master]  # made on the host: locked in place, not copied
    key = "allocated_bytes.current"  # what torch's caching (power-of-two) pinned allocator holds
    held = torch.cuda.host_memory_stats().get(key)
    for step in range(3):
        g = torch.Generator(device="cuda").manual_seed(step)
        for pa, pb in zip(on.params, off.params):
            pa.grad = torch.randn(pa.shape, generator=g, device="cuda").to(pa.dtype)
            pb.grad = pa.grad.clone()
        on.clip_and_step(1.0)
        off.clip_and_step(1.0)
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert on.on_host and on._host
    state = 0
    for (i, name), h in on._host.items():
        assert h.is_pinned(), (i, name)
        state += h.numel() * h.element_size()
        if name == "master":
            assert h.data_ptr() == cpu_masters[i]
    if held is not None:  # none of the state came from the caching allocator (a scalar read may take a block)
        assert torch.cuda.host_memory_stats()[key] - held < state // 100
