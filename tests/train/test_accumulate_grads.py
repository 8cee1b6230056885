"""accumulate_grads: the backward adds into the persistent .grad buffers in place, bit for bit what computing every
gradient and adding it afterwards gives, and a warm-up run leaves the buffers alone."""

from __future__ import annotations

import torch
from torch import nn

from exactrl.train.graphs import accumulate_grads


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    emb = nn.Embedding(50, 16)
    m = nn.ModuleDict({"emb": emb, "mid": nn.Linear(16, 16), "frozen": nn.Linear(16, 16)})
    m.frozen.requires_grad_(False)
    m.to(torch.bfloat16)
    for p in m.parameters():  # trained-looking weights: not the init's small uniform values
        with torch.no_grad():
            p.mul_(7.3).add_(0.01)
    return m


def _loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    h = m.emb(ids)
    h = torch.tanh(m.mid(h)) + m.frozen(h)
    logits = h @ m.emb.weight.t()  # a tied head: the embedding gets two gradients, summed once
    return torch.log_softmax(logits.float(), -1).mean() * 3.1


def _params_and_buffers(m: nn.Module) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    return params, [p.grad for p in params]


def test_accumulate_matches_grads_then_add_bitwise_and_keeps_buffers() -> None:
    batches = [torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    m = _model(0)
    params, bufs = _params_and_buffers(m)
    ptrs = [b.data_ptr() for b in bufs]
    for ids in batches:
        accumulate_grads(_loss(m, ids), params, bufs, True)
    ref = _model(0)
    rparams, rbufs = _params_and_buffers(ref)
    for ids in batches:  # the reference: every gradient first, then one add into the buffers
        grads = torch.autograd.grad(_loss(ref, ids), rparams)
        torch._foreach_add_(rbufs, list(grads))
    assert [p.grad.data_ptr() for p in params] == ptrs  # in place: a CUDA graph's buffers stay valid
    for b, r in zip(bufs, rbufs):
        assert b.dtype == torch.bfloat16 and torch.equal(b, r)
    assert any(b.abs().sum() > 0 for b in bufs)
    assert m.frozen.weight.grad is None


def test_warm_up_leaves_buffers_alone() -> None:
    m = _model(1)
    params, bufs = _params_and_buffers(m)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(9))
    accumulate_grads(_loss(m, ids), params, bufs, True)
    before = [b.clone() for b in bufs]
    accumulate_grads(_loss(m, ids), params, bufs, False)
    assert all(p.grad is b for p, b in zip(params, bufs))
    assert all(torch.equal(b, x) for b, x in zip(bufs, before))
    # and the hooks are gone: the next accumulation adds as usual
    accumulate_grads(_loss(m, ids), params, bufs, True)
    assert not all(torch.equal(b, x) for b, x in zip(bufs, before))


def test_refuses_a_grad_that_is_not_the_buffer() -> None:
    m = _model(2)
    params, bufs = _params_and_buffers(m)
    params[0].grad = torch.zeros_like(params[0])
    ids = torch.randint(0, 50, (2, 5))
    try:
        accumulate_grads(_loss(m, ids), params, bufs, True)
    except RuntimeError as e:
        assert "persistent buffer" in str(e)
    else:
        raise AssertionError("a .grad that is not the buffer was accepted")


def test_gradients_land_in_the_buffers_during_the_backward() -> None:
    """The memory claim: each gradient is added into its buffer as soon as autograd has it (a post-accumulate hook
    sees it land once per parameter), not gathered into a whole second set first and added afterwards; and in the
    warm-up each one is dropped as it lands (at most one gradient held at any moment)."""
    m = _model(3)
    params, bufs = _params_and_buffers(m)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(4))
    landed: list[int] = []
    held: list[int] = []

    def seen(p: torch.Tensor) -> None:
        landed.append(id(p))
        held.append(sum(q.grad is not None for q in params))

    hooks = [p.register_post_accumulate_grad_hook(seen) for p in params]
    try:
        accumulate_grads(_loss(m, ids), params, bufs, True)
        assert sorted(landed) == sorted(id(p) for p in params), "a gradient did not land in its .grad"
        landed.clear()
        held.clear()
        # Registered before the warm-up's own hooks, `seen` runs before each gradient is dropped: the one landing
        # now is the only one held.
        accumulate_grads(_loss(m, ids), params, bufs, False)
        assert len(landed) == len(params) and held == [1] * len(params), held
    finally:
        for h in hooks:
            h.remove()
    assert all(p.grad is b for p, b in zip(params, bufs))
