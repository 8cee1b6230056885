"""Who does what in a torchrun run: colocated ranks, or generator ranks apart from trainer ranks.

Colocated (`distributed.generator_ranks = 0`, the default): every rank holds an engine replica and a trainer
shard and they take turns; `Layout.local` is the whole job's context.

Disaggregated (G = `distributed.generator_ranks` > 0 of W ranks): ranks 0..N-1 (N = W - G) train, FSDP2 among
themselves in a process group of their own (`Layout.local` is that group's context: rank 0 is still the job's rank
0, which owns the run directory); ranks N..W-1 run only the rollout engine. Generator g (rank N + j) serves the
trainers r with r % G == j. What moves between them:

- trainer r -> its generator: commands (generate these prompts with these request ids, take new weights, stop),
  pickled point to point (`Layout.send` / `Layout.recv`); generator -> trainer r: the request outputs (token ids,
  rollout logprobs, finish reasons). The messages travel on a gloo group of their own, in host memory: on the
  default group (NCCL on GPUs) a trainer waiting for its batch would hold a receive on its GPU, beside its update,
  for as long as the generation takes, and every message would be a device copy and a stream synchronization.
- trainer 0 -> every generator: the weights, in the model dtype, as buckets broadcast over the group of trainer 0
  and the generators (`send_weights` / `recv_weights`), copied into the engine's own tensors in place (its CUDA
  graphs keep their addresses). The bytes are the trainer replica's, which FSDP2's cast-then-gather filled: the
  generators sample with the very bits the colocated engine would hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from exactrl.distributed.env import DistContext

# A broadcast bucket: large enough that a 1.7B model moves in a dozen collectives, small enough to stage twice.
BUCKET_BYTES = 256 << 20


@dataclass
class Layout:
    """This rank's role in the job and the process groups of the disaggregated layout."""

    world: DistContext  # every rank of the job (the default group)
    generators: int  # G: 0 = colocated
    role: str  # "colocated", "trainer" or "generator"
    local: DistContext  # the ranks this rank trains with (the trainers' group), or the job's
    sync_group: Any = None  # trainer 0 and the generators: the weights' broadcast
    msg_group: Any = None  # every rank, gloo: the commands and outputs

    def send(self, obj: Any, dst: int) -> None:
        """One pickled object to global rank `dst`, over the messages' group."""
        send_object(obj, dst, self.msg_group)

    def recv(self, src: int) -> Any:
        """The object global rank `src` sent with `send`."""
        return recv_object(src, self.msg_group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` in global rank order, over the messages' group when there is one (host memory: the
        default group's first NCCL collective would set up a communicator on devices the run has filled)."""
        if not self.world.distributed:
            return [obj]
        out: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(out, obj, group=self.msg_group)
        return out

    @property
    def trainers(self) -> int:
        return self.world.world_size - self.generators

    @property
    def disaggregated(self) -> bool:
        return self.generators > 0

    def generator_of(self, trainer_rank: int) -> int:
        """The global rank of the generator that serves trainer `trainer_rank`."""
        return self.trainers + trainer_rank % self.generators

    def trainers_of(self, generator_rank: int) -> list[int]:
        """The trainer ranks that generator `generator_rank` (global) serves, in rank order."""
        j = generator_rank - self.trainers
        return [r for r in range(self.trainers) if r % self.generators == j]


def split_layout(world: DistContext, generator_ranks: int) -> Layout:
    """The job's layout (every rank calls this: the groups are made collectively). Refuses what cannot work:
    generators without torchrun, no rank left to train, a generator with no trainer to serve."""
    if generator_ranks == 0:
        return Layout(world, 0, "colocated", world)
    where = f"distributed.generator_ranks = {generator_ranks}"
    if not world.distributed:
        raise ValueError(
            f"{where} needs torchrun ranks (`exactrl train --nproc N`): one process has no rank to spare for "
            "generation; set it to 0"
        )
    if generator_ranks >= world.world_size:
        raise ValueError(
            f"{where} with {world.world_size} ranks leaves no rank to train: it must be below the world size"
        )
    trainers = world.world_size - generator_ranks
    if generator_ranks > trainers:
        raise ValueError(
            f"{where} with {world.world_size} ranks: more generators than trainers ({trainers}), and a generator "
            "serves whole trainer shares, so some would have nothing to do; use at most world size / 2 generators"
        )
    trainer_group = dist.new_group(ranks=list(range(trainers)))
    sync_group = dist.new_group(ranks=[0, *range(trainers, world.world_size)])
    msg_group = dist.new_group(backend="gloo")  # a group of its own on CPU ranks too: the path GPUs take
    if world.rank < trainers:
        local = DistContext(world.rank, trainers, world.local_rank, world.backend, group=trainer_group)
        return Layout(world, generator_ranks, "trainer", local, sync_group, msg_group)
    return Layout(world, generator_ranks, "generator", world, sync_group, msg_group)


# -- messages: one pickled object, point to point (global ranks) ----------------------------------------------
def send_object(obj: Any, dst: int, group: Any = None) -> None:
    dist.send_object_list([obj], dst=dst, group=group)


def recv_object(src: int, group: Any = None) -> Any:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


# -- weights: bucketed broadcasts, trainer 0 -> the generators ---------------------------------------------
def buckets(tensors: Sequence[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive indices of `tensors` grouped into buckets of one dtype and at most `limit` bytes (a larger
    tensor is a bucket of its own). Both sides compute the same buckets from the same shapes and dtypes."""
    out: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if out and tensors[out[-1][-1]].dtype == t.dtype and size + n <= limit:
            out[-1].append(i)
            size += n
        else:
            out.append([i])
            size = n
    return out


def send_weights(tensors: Sequence[torch.Tensor], group: Any, limit: int = BUCKET_BYTES) -> int:
    """Broadcast `tensors` from this rank (trainer 0) to the group, bucket by bucket; returns the bytes sent."""
    moved = 0
    src = dist.get_rank()
    for idx in buckets(tensors, limit):
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        dist.broadcast(flat, src=src, group=group)
        moved += flat.numel() * flat.element_size()
    return moved


@torch.no_grad()
def recv_weights(tensors: Sequence[torch.Tensor], group: Any, src: int = 0, limit: int = BUCKET_BYTES) -> int:
    """Receive `send_weights`'s buckets and copy each slice into its tensor in place (no tensor is replaced, so
    captured CUDA graphs stay valid); returns the bytes received."""
    moved = 0
    for idx in buckets(tensors, limit):
        total = sum(tensors[i].numel() for i in idx)
        flat = torch.empty(total, dtype=tensors[idx[0]].dtype, device=tensors[idx[0]].device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for i in idx:
            t = tensors[i]
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        moved += flat.numel() * flat.element_size()
    return moved
