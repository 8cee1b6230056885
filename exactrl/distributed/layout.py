"""Who does what in a torchrun run: colocated ranks, or generator ranks apart from trainer ranks.

Colocated (`distributed.generator_ranks = 0`, the default): every rank holds an engine replica and a trainer
shard and they take turns; `Layout.local` is the whole job's context.

Disaggregated (G = `distributed.generator_ranks` > 0 of W ranks): ranks 0..N-1 (N = W - G) train, FSDP2 among
themselves in a process group of their own (`Layout.local` is that group's context: rank 0 is still the job's rank
0, which owns the run directory); ranks N..W-1 run only the rollout engine. Generator g (rank N + j) serves the
trainers r with r % G == j. With an engine split over S ranks (engine.tensor_parallel / expert_parallel = S,
exactrl/distributed/shared_engine.py) the generators form G / S consecutive groups of S, each one engine: group j
(ranks N + j*S .. N + j*S + S - 1) serves the trainers r with r % (G / S) == j; a trainer sends each command to every
rank of its group (they run the same engine calls in the same order, every forward a collective among them) and
hears the answer from the group's first rank. What moves between them:

- trainer r -> its generator: commands (generate these prompts with these request ids, take new weights, stop),
  pickled point to point (`Layout.send` / `Layout.recv`); generator -> trainer r: the request outputs (token ids,
  rollout logprobs, finish reasons). The messages travel on a gloo group of their own, in host memory: on the
  default group (NCCL on GPUs) a trainer waiting for its batch would hold a receive on its GPU, beside its update,
  for as long as the generation takes, and every message would be a device copy and a stream synchronization.
- trainer 0 -> every generator: the weights, in the model dtype, as buckets broadcast over the group of trainer 0
  and the generators (`send_weights` / `recv_weights`), copied into the engine's own tensors in place (its CUDA
  graphs keep their addresses); a split engine's rank copies its slice of each whole weight. The bytes are the trainer replica's, which FSDP2's cast-then-gather filled: the
  generators sample with the very bits the colocated engine would hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    group_size: int = 1  # S: the generator ranks that share one engine
    engine_group: Any = None  # a generator rank's TensorParallelGroup when S > 1

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

    @property
    def engines(self) -> int:
        """The generators' engines: G / S."""
        return self.generators // self.group_size

    def generator_of(self, trainer_rank: int) -> int:
        """The global rank of the generator that serves trainer `trainer_rank` (its group's first rank, which
        answers)."""
        return self.trainers + (trainer_rank % self.engines) * self.group_size

    def generators_of(self, trainer_rank: int) -> list[int]:
        """Every rank of the engine that serves trainer `trainer_rank` (each gets its commands)."""
        first = self.generator_of(trainer_rank)
        return list(range(first, first + self.group_size))

    def trainers_of(self, generator_rank: int) -> list[int]:
        """The trainer ranks that generator `generator_rank` (global) serves, in rank order."""
        j = (generator_rank - self.trainers) // self.group_size
        return [r for r in range(self.trainers) if r % self.engines == j]

    def answers(self, generator_rank: int) -> bool:
        """Whether generator `generator_rank` sends its engine's outputs back (its group's first rank)."""
        return (generator_rank - self.trainers) % self.group_size == 0


def split_layout(world: DistContext, generator_ranks: int, group_size: int = 1) -> Layout:
    """The job's layout (every rank calls this: the groups are made collectively). group_size: the ranks that share
    one engine (engine.tensor_parallel / expert_parallel); with generators, those of each engine's group. Refuses
    what cannot work: generators without torchrun, no rank left to train, an engine with no trainer to serve,
    generators the group size does not divide."""
    if generator_ranks == 0:
        return Layout(world, 0, "colocated", world)
    trainers = trainer_ranks(world.world_size, generator_ranks, group_size, distributed=world.distributed)
    engines = generator_ranks // group_size
    trainer_group = dist.new_group(ranks=list(range(trainers)))
    sync_group = dist.new_group(ranks=[0, *range(trainers, world.world_size)])
    msg_group = dist.new_group(backend="gloo")  # a group of its own on CPU ranks too: the path GPUs take
    engine_group = None
    if group_size > 1:  # each engine's ranks (every rank makes every group, in the same order)
        from exactrl.distributed.tensor_parallel import TensorParallelGroup

        for j in range(engines):
            ranks = list(range(trainers + j * group_size, trainers + (j + 1) * group_size))
            g = dist.new_group(ranks=ranks)
            if world.rank in ranks:
                engine_group = TensorParallelGroup(group_size, ranks.index(world.rank), g, j, engines)
    if world.rank < trainers:
        local = DistContext(world.rank, trainers, world.local_rank, world.backend, group=trainer_group)
        return Layout(world, generator_ranks, "trainer", local, sync_group, msg_group, group_size)
    return Layout(world, generator_ranks, "generator", world, sync_group, msg_group, group_size, engine_group)


def trainer_ranks(
    world_size: int, generator_ranks: int, group_size: int = 1, *, distributed: bool = True
) -> int:
    """The ranks that train among `world_size` (all of them when generator_ranks is 0): what the trainers' FSDP2
    shards and a plan divide by. Refuses, by key, the layouts that cannot work (`split_layout`'s, and what `exactrl
    plan` / `train --nproc N` check before any rank starts): generators without torchrun, no rank left to train,
    an engine with no trainer to serve, generators the engine's group size does not divide."""
    if generator_ranks == 0:
        return world_size
    where = f"distributed.generator_ranks = {generator_ranks}"
    if group_size < 1 or generator_ranks % group_size:
        raise ValueError(
            f"{where} with an engine split over {group_size} ranks (engine.tensor_parallel / expert_parallel): "
            "every engine needs that many generator ranks of its own, so it must divide the generator ranks"
        )
    if not distributed:
        raise ValueError(
            f"{where} needs torchrun ranks (`exactrl train --nproc N`): one process has no rank to spare for "
            "generation; set it to 0"
        )
    if generator_ranks >= world_size:
        raise ValueError(
            f"{where} with {world_size} ranks leaves no rank to train: it must be below the world size"
        )
    trainers = world_size - generator_ranks
    engines = generator_ranks // group_size
    if engines > trainers:
        raise ValueError(
            f"{where} with {world_size} ranks: more generator engines ({engines}) than trainers ({trainers}), "
            "and an engine serves whole trainer shares, so some would have nothing to do; use at most world size / "
            "2 generators (with engines of one rank)"
        )
    return trainers


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
def recv_weights(
    tensors: Sequence[torch.Tensor],
    group: Any,
    src: int = 0,
    limit: int = BUCKET_BYTES,
    *,
    shapes: Sequence[Sequence[int]] | None = None,
    put: Callable[[int, torch.Tensor], None] | None = None,
) -> int:
    """Receive `send_weights`'s buckets and copy each slice into its tensor in place (no tensor is replaced, so
    captured CUDA graphs stay valid); returns the bytes received. A split engine's rank: `shapes` are the whole
    tensors' shapes that were sent (the buckets are the sender's). `put(i, whole)`, where given, puts whole tensor i
    (a view of the bucket) where it goes instead (a split engine's slice into tensor i; a generator's fp8 copy);
    `tensors` then give the buckets' dtype and device."""
    moved = 0
    if shapes is None:
        sent: Sequence[torch.Tensor] = tensors
    else:
        sent = [torch.empty(tuple(s), dtype=t.dtype, device="meta") for s, t in zip(shapes, tensors)]
    for idx in buckets(sent, limit):
        total = sum(sent[i].numel() for i in idx)
        flat = torch.empty(total, dtype=tensors[idx[0]].dtype, device=tensors[idx[0]].device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for i in idx:
            whole = flat[offset : offset + sent[i].numel()].view(sent[i].shape)
            if put is None:
                tensors[i].copy_(whole)
            else:
                put(i, whole)
            offset += sent[i].numel()
        moved += flat.numel() * flat.element_size()
    return moved
