"""What each rank of a torchrun launch does, in one console line: the launcher (`exactrl ... --nproc N`) prints it
once, before torchrun starts the ranks. The roles are `exactrl.distributed.layout`'s: with G generator ranks of N,
ranks 0..N-G-1 train and the last G generate, in engines of S = max(T, E) ranks (engine.tensor_parallel = T,
engine.expert_parallel = E); engine j serves the trainers r with r % (G / S) == j. Colocated (G = 0), every rank
trains and generates, its engine its own (S = 1) or split over groups of S consecutive ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Roles:
    """The roles a command gives its ranks (what its config or options say; nothing is checked here)."""

    device: str  # the command's resolved device: "cpu", "cuda", ...
    generator_ranks: int = 0  # G: 0 = colocated
    tensor_parallel: int = 1  # T
    expert_parallel: int = 1  # E
    trains: bool = True  # the colocated ranks train (FSDP2 over the trainers)
    generates: bool = True  # and generate


def _span(ranks: list[int]) -> str:
    """[0, 1, 2] -> "0-2"; [0, 2] -> "0, 2"."""
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {_span(ranks)}"


def roles_line(nproc: int, roles: Roles, per_node: int | None = None) -> str:
    """One line: which ranks train and which generate, the engines and their split, and the devices (`per_node`:
    the ranks of one node, when the ranks span several)."""
    g, t, e = roles.generator_ranks, roles.tensor_parallel, roles.expert_parallel
    s = max(t, e)
    split = f"T={t} E={e}"
    verb = lambda word, ranks: word if len(ranks) > 1 else word + "s"  # noqa: E731

    def fsdp(n: int) -> str:
        return f"FSDP2 over {n} rank{'s' if n > 1 else ''}"

    if g == 0:
        every = list(range(nproc))
        engines = nproc // s
        engine = (
            f"{'an engine each' if nproc > 1 else 'its own engine'}, {split}"
            if s == 1
            else f"{engines} engine{'s' if engines > 1 else ''} of {s} ranks, {split}"
        )
        does = [(w, d) for w, d, on in (("train", fsdp(nproc), roles.trains), ("generate", engine, roles.generates)) if on]  # fmt: skip
        parts = [f"{_ranks(every)} " + " and ".join(f"{verb(w, every)} ({d})" for w, d in does)]
    else:
        trainers = list(range(nproc - g))
        engines = g // s
        parts = [f"{_ranks(trainers)} {verb('train', trainers)} ({fsdp(len(trainers))})"]
        for j in range(engines):
            own = list(range(len(trainers) + j * s, len(trainers) + (j + 1) * s))
            served = [r for r in trainers if r % engines == j]
            engine = split if s == 1 else f"one engine, {split}"
            parts.append(
                f"{_ranks(own)} {verb('generate', own)} ({engine}) for trainer{'s' if len(served) > 1 else ''} "
                f"{_span(served)}"
            )
    if roles.device.startswith("cuda"):
        local = per_node or nproc
        where = f"one GPU each, cuda:0-{local - 1} by LOCAL_RANK" if nproc > 1 else "cuda:0"
        if local < nproc:
            where += f" on each of {nproc // local} nodes"
    else:
        where = f"the {roles.device.upper() if roles.device == 'cpu' else roles.device} (gloo)"
    return f"exactrl: {nproc} rank{'s' if nproc > 1 else ''}: {'; '.join(parts)}; on {where}"
