"""Every policy loss of the menu runs inside a captured CUDA graph (forward and backward) and its replay gives the
eager bits (marker `gpu`). The trainer captures `policy_loss_terms` in its microbatch graph, so a loss that read a
value back to the host, or branched in Python on data, would fail to capture or replay stale decisions."""

from __future__ import annotations

import pytest
import torch

from exactrl.algorithms import POLICY_LOSS_KINDS, policy_loss_terms

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, T = 16, 48
OPTIONS = dict(
    clip_cov_ratio=0.05, clip_cov_lb=0.05, clip_cov_ub=50.0, kl_cov_ratio=0.05, eps_low=0.2, eps_high=0.28
)


def _data(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[-1] = 0  # a padding row, as in the trainer's buckets
    old = -torch.rand(B, T, generator=g) * 4
    return {
        "theta": old + 0.3 * torch.randn(B, T, generator=g),
        "old": old,
        "adv": 2 * torch.randn(B, generator=g),
        "mask": torch.arange(T)[None, :] < lengths[:, None],
        "divisor": lengths.sum().float(),
    }


def _step(x: dict[str, torch.Tensor], theta: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss, metrics and gradient with respect to theta: tensors only, as in the trainer's captured body."""
    logp = theta * 1.0  # the differentiable "current log-probs"
    loss, metrics = policy_loss_terms(
        logp, x["old"], x["adv"], x["mask"], kind=kind, loss_divisor=x["divisor"], **OPTIONS
    )
    (grad,) = torch.autograd.grad(loss, theta)
    return torch.stack([v.reshape(()).float() for v in metrics.values()]), grad


@pytest.mark.parametrize("kind", POLICY_LOSS_KINDS)
def test_graph_replay_equals_eager(kind: str) -> None:
    dev = torch.device("cuda")
    static = {k: v.to(dev) for k, v in _data(0).items()}
    theta = static.pop("theta").requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graphs asks
        for _ in range(2):
            _step(static, theta, kind)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_metrics, out_grad = _step(static, theta, kind)

    for seed in (1, 2, 3):
        fresh = {k: v.to(dev) for k, v in _data(seed).items()}
        want_metrics, want_grad = _step(fresh, fresh["theta"].clone().requires_grad_(True), kind)
        if seed == 1:
            # Negative control: replaying without the new inputs gives other numbers, so equality below means
            # the graph really recomputed from the copied inputs.
            graph.replay()
            assert not torch.equal(out_grad, want_grad)
        with torch.no_grad():
            theta.copy_(fresh["theta"])
        for k in static:
            static[k].copy_(fresh[k])
        graph.replay()
        assert torch.equal(out_grad, want_grad), kind
        assert torch.equal(out_metrics, want_metrics), kind
        assert bool(torch.isfinite(out_grad).all())
    if kind in ("clip_cov", "kl_cov"):
        names = list(
            policy_loss_terms(theta, static["old"], static["adv"], static["mask"], kind=kind, **OPTIONS)[1]
        )
        assert float(out_metrics[names.index("cov_select_frac")]) > 0  # the selection is exercised
