"""The process group of a run under torchrun, and the few collectives the RL loop needs.

World size 1 without torchrun is `DistContext.single()`: no process group, every collective the identity, so
the single-device path runs exactly as before. Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK in the
environment) `init_from_env` starts the process group: gloo on the CPU, NCCL on CUDA, with a timeout on every
collective so that a rank that died or hangs stops the others with an error instead of a hang (torchrun's agent
also terminates the surviving ranks as soon as one exits with an error).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    """Who this process is in the run. Collectives go through the default process group (if any)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: no process group (world size 1 without torchrun)
    # The process group of these ranks: None is the default group (every rank of the job). The trainers of a
    # disaggregated run (distributed.generator_ranks > 0) have one of their own: rank and world_size are then
    # their places in it, and every collective below stays among them.
    group: Any = None

    @staticmethod
    def single() -> DistContext:
        return DistContext()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    # -- collectives (identity without a process group) ----------------------------------------------------
    def _device(self) -> torch.device:
        # NCCL reduces device tensors; gloo host tensors.
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Element-wise reduction of a short vector of floats over the ranks (float64)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        dist.all_reduce(
            t,
            op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op],
            group=self.group,
        )
        return t.tolist()

    def sum(self, x: float) -> float:
        return self.all_reduce([x], "sum")[0]

    def max(self, x: float) -> float:
        return self.all_reduce([x], "max")[0]

    def gather_floats(self, x: float) -> list[float]:
        """Every rank's `x`, in rank order, on every rank (one all-reduce of a world-size vector in float64: each
        rank fills its own slot, the others add zeros, so every value arrives exact)."""
        slots = [0.0] * self.world_size
        slots[self.rank] = float(x)
        return self.all_reduce(slots, "sum")

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (pickled between the ranks of this run only)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_rows(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each [N_r, L_r] CPU tensor concatenated over the ranks along dim 0 (right-padded with zeros to the
        widest L): a step-level view of per-rank rows, for metrics that must be global."""
        if not self.distributed:
            return tensors
        parts = self.all_gather_object([t.cpu() for t in tensors])
        out = []
        for k in range(len(tensors)):
            rows = [p[k] for p in parts]
            width = max(r.shape[1] for r in rows)
            rows = [torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows]
            out.append(torch.cat(rows))
        return tuple(out)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def shard(self, n: int) -> range:
        """The indices [0, n) that this rank owns: a contiguous share, the first `n % world_size` ranks one
        more (n = 5 on 2 ranks: 0..2 and 3..4)."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))


def per_rank_metric(ctx: DistContext, name: str, value: float) -> dict[str, float]:
    """A metric that differs between the ranks (peak memory, a rank's own wall time) as step metrics: `name` is
    the maximum over the ranks (the run's worst, the same on every rank), and under several ranks
    `name/rank<r>` holds rank r's own value. A collective: every rank calls it at the same point."""
    values = ctx.gather_floats(value)
    out = {name: max(values)}
    if ctx.world_size > 1:
        out.update({f"{name}/rank{r}": v for r, v in enumerate(values)})
    return out


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# Intra-op threads of the host in a GPU run. Measured on an H200 host (16 cores, 2026-11-28, qwen3-0.6b exact step
# of 8 x 1,024 tokens, benchmarks/probe_host_side.py): torch's default of one OpenMP thread per core, 98.8 ms a
# step, 199.8 ms with one busy core beside it (every parallel region of the step's host-side bookkeeping waits for
# the thread that lost its core: aten::index 69 ms, exp 14 ms); 4 threads: 94.4 ms with the busy core, 93.9 without.
HOST_THREADS_CUDA = 4


def limit_host_threads(device: str | torch.device) -> int:
    """On a CUDA run, cap torch's intra-op threads at HOST_THREADS_CUDA: the host's torch ops there are bookkeeping
    on kilobyte tensors (masks, advantages, packing), where a fork-join over every core costs more than it saves
    and one busy core stalls every region. Left alone: CPU runs (their math is the host's), and a process whose
    OMP_NUM_THREADS was set (by the user, or by torchrun for several ranks). Returns the thread count now. Every
    `exactrl` command passes it before its work (exactrl.cli.cap_host_threads), as do the benchmark scripts
    (benchmarks/_script.py) and `init_from_env` for code that starts a run without the CLI."""
    if torch.device(device).type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, min(HOST_THREADS_CUDA, torch.get_num_threads())))
    return torch.get_num_threads()


# How long a collective waits for the other ranks before it fails (`init_from_env`).
PROCESS_GROUP_TIMEOUT_S = 1800.0


def init_from_env(device: str, timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> DistContext:
    """Start the process group when launched by torchrun, else the single-process context.

    device: the run's resolved device ("cpu", "cuda", "cuda:N"): gloo on the CPU, NCCL on CUDA, where each rank
    takes the GPU of its LOCAL_RANK. timeout_s bounds every collective: long enough for rank 0's held-out
    evaluation, which the other ranks wait out at their next collective; a rank that dies is caught sooner, by
    torchrun, which stops the others. On CUDA it also caps the host's intra-op threads (`limit_host_threads`)."""
    limit_host_threads(device)
    if not under_torchrun():
        return DistContext.single()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        device_id: dict[str, Any] = {"device_id": torch.device("cuda", local)} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **device_id)
    from exactrl.distributed import heartbeat
    from exactrl.distributed.heartbeat import note_rank_pid

    note_rank_pid()
    heartbeat.start(rank, world)  # a lost peer or launcher stops this rank in seconds, in one line
    return DistContext(rank=rank, world_size=world, local_rank=local, backend=backend)


def rank_device(ctx: DistContext, device: str) -> str:
    """The device this rank computes on: its own GPU under torchrun on CUDA."""
    if ctx.backend == "nccl":
        return f"cuda:{ctx.local_rank}"
    return device


def leave_process_group() -> None:
    """Leave the default process group, then pause a moment, GIL released. The caller has passed a barrier with
    every rank first (no rank tears its transport down while a peer is still inside a collective).

    The backend's worker threads can outlive the group (torch's own caches keep it alive: DTensor sharding specs
    under FSDP, torch._dynamo when imported after the group started), and one of them frees the last collective's
    tensors, which needs the GIL. If the interpreter is already shutting down by then, that thread is killed inside
    C++ and the rank dies with SIGABRT ("terminate called without an active exception") after its work is done:
    torchrun then reports a finished command as failed. Measured on 2 gloo ranks whose last collective was
    all_gather_object: 15 of 30 launches aborted without the pause, 0 of 30 with it."""
    import time

    from exactrl.distributed import heartbeat

    heartbeat.finish()
    dist.destroy_process_group()
    time.sleep(0.1)


def shutdown(ctx: DistContext) -> None:
    """Every rank's work is done: leave the process group together (a barrier, then `leave_process_group`)."""
    if ctx.distributed and dist.is_initialized():
        dist.barrier()
        leave_process_group()
