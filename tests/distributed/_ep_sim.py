"""An expert-parallel engine split over E ranks, simulated in one process (no launch): the tests of the expert
combine (test_expert_combine_order.py) and of the decode path a capture takes (test_expert_parallel_graphs_gpu.py).

One rank's `ExpertParallelExperts` runs for real; its group's `gather` returns, for every other rank, that rank's slot
outputs computed from the same input (each peer's experts run every slot the static way, `id % per`, as a peer's
static decode step would: rows of experts it does not hold are computed and never read, so they need no care). The
peers' part has no host synchronisation and no data-dependent shape, so it runs inside a CUDA graph capture too.
What this rank's module decides (which path, which slots, the combine) is the code under test; `calls` records, for
each forward, whether it ran inside the static decode step or a capture and how many rows it handed the experts op.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from exactrl.distributed.expert_parallel import ExpertParallelExperts
from exactrl.model.moe import Experts, SparseMoeBlock, in_static_decode_step
from exactrl.ops import Ops


@dataclass
class Call:
    static: bool  # inside the engine's static decode step
    capturing: bool  # inside a CUDA graph capture
    slots: int  # T * k of the call
    rows: int  # the rows this rank's module handed `ops.moe_experts`


@dataclass
class SimGroup:
    """The part of a TensorParallelGroup `ExpertParallelExperts` uses, for rank `rank` of `size`."""

    size: int
    rank: int
    peers: list[ExpertParallelExperts | None] = field(
        default_factory=list
    )  # every rank's module, this one's None
    pending: tuple | None = None  # (ops, x, ids) of the forward in progress

    def gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        assert self.pending is not None
        ops, x, ids = self.pending
        out = []
        for peer in self.peers:
            if peer is None:
                out.append(mine)
                continue
            T, k = ids.shape
            per = peer.gate_up.shape[0]
            rows = x.unsqueeze(1).expand(T, k, x.shape[1]).reshape(T * k, x.shape[1])
            ones = torch.ones(T * k, 1, dtype=torch.float32, device=x.device)
            out.append(ops.moe_experts(rows, peer.gate_up, peer.down, ones, (ids.reshape(-1) % per)[:, None]))
        return out


class _CountingOps:
    """The backend, with the rows of every `moe_experts` call counted."""

    def __init__(self, ops: Ops, rows: list[int]):
        self._ops, self._rows = ops, rows

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def moe_experts(self, x, *args):
        self._rows.append(x.shape[0])
        return self._ops.moe_experts(x, *args)


class SimulatedExperts(ExpertParallelExperts):
    """Rank `group.rank`'s experts of a split engine; `calls`: what each forward did."""

    def __init__(self, experts: Experts, group: SimGroup, calls: list[Call]):
        super().__init__(experts, group)  # type: ignore[arg-type]
        self.calls = calls

    def forward(self, ops: Ops, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows: list[int] = []
        self.group.pending = (ops, x, ids)
        try:
            out = super().forward(_CountingOps(ops, rows), x, weights, ids)
        finally:
            self.group.pending = None
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        self.calls.append(Call(in_static_decode_step(), capturing, ids.numel(), sum(rows)))
        return out


def split_experts(experts: Experts, size: int, rank: int, calls: list[Call]) -> SimulatedExperts:
    group = SimGroup(size, rank)
    group.peers = [
        None if r == rank else ExpertParallelExperts(experts, SimGroup(size, r))  # type: ignore[arg-type]
        for r in range(size)
    ]
    return SimulatedExperts(experts, group, calls)


def split_model(model: nn.Module, size: int, rank: int = 0) -> tuple[nn.Module, list[Call]]:
    """A copy of `model` whose sparse layers' experts are rank `rank`'s of an engine split over `size` ranks."""
    model = copy.deepcopy(model)
    calls: list[Call] = []
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            m.experts = split_experts(m.experts, size, rank, calls)
    return model, calls
