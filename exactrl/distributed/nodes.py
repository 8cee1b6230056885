"""Where the ranks of a launch run: one node (`--nproc N`), or several (`--nnodes N --nproc-per-node P
--rdzv-endpoint HOST:PORT --node-rank R`), and the torchrun arguments that place them.

Several nodes use torchrun's static rendezvous, so that placement is fixed by the command, not by which node joins
first: node R holds global ranks R*P .. R*P+P-1 (local rank l is global rank R*P + l). Rank 0, which writes the run
directory, the logs and the checkpoints' metadata, is therefore local rank 0 of node 0, and node 0 must run on HOST:
its launcher serves the rendezvous store at HOST:PORT that every rank joins. Generator ranks
(`distributed.generator_ranks = G`) are the last G global ranks (exactrl.distributed.layout), so they land on the last
node(s). Under Slurm (`srun`) --node-rank defaults to SLURM_NODEID.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Nodes:
    """The ranks of a launch: `nnodes` nodes of `nproc_per_node` ranks each. `endpoint` (HOST:PORT) and `node_rank`
    are None on one node (torchrun --standalone: a free local port)."""

    nnodes: int
    nproc_per_node: int
    endpoint: str | None = None
    node_rank: int | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def first_rank(self) -> int:
        """The global rank of this node's local rank 0."""
        return (self.node_rank or 0) * self.nproc_per_node

    def torchrun_args(self) -> list[str]:
        if self.endpoint is None:
            return ["--standalone", f"--nproc-per-node={self.nproc_per_node}"]
        host, port = self.endpoint.rsplit(":", 1)
        return [
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--node-rank={self.node_rank}",
            "--rdzv-backend=static",
            f"--master-addr={host}",
            f"--master-port={port}",
        ]

    def describe(self) -> str:
        if self.endpoint is None:
            return f"{self.nproc_per_node} ranks"
        last = self.first_rank + self.nproc_per_node - 1
        return (
            f"node {self.node_rank} of {self.nnodes} (ranks {self.first_rank}..{last} of {self.world_size}, "
            f"rendezvous {self.endpoint})"
        )


def add_nodes_args(p: argparse.ArgumentParser) -> None:
    """The flags of a launch on several nodes (run the same command on every node, --node-rank aside)."""
    g = p.add_argument_group("several nodes (run the same command on every node)")
    g.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="nodes in the run; node R holds global ranks R*P .. R*P+P-1 (P = --nproc-per-node), so rank 0 "
        "is on node 0 and generator ranks (the last distributed.generator_ranks ranks) on the last node",
    )
    g.add_argument("--nproc-per-node", type=int, default=None, help="ranks on each node (with --nnodes)")
    g.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        default=None,
        help="node 0's address and a free port on it: its launcher serves the rendezvous store there",
    )
    g.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this node's place, 0 .. N-1 (default: SLURM_NODEID under srun); node 0 must run on HOST",
    )


def nodes_from_args(args: argparse.Namespace) -> Nodes | None:
    """The launch the command asks for (None: none, run in this process). Raises ValueError naming the flag."""
    nproc, nnodes = getattr(args, "nproc", None), getattr(args, "nnodes", None)
    if nnodes is None:
        for flag in ("nproc_per_node", "rdzv_endpoint", "node_rank"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --nnodes N (the nodes in the run)")
        return None if nproc is None else Nodes(1, nproc)
    if nproc is not None:
        raise ValueError("--nproc is one node's launch; with --nnodes give --nproc-per-node P instead")
    per, endpoint, node_rank = args.nproc_per_node, args.rdzv_endpoint, args.node_rank
    if nnodes < 1 or per is None or per < 1:
        raise ValueError(f"--nnodes {nnodes} needs --nproc-per-node P (at least 1) and --nnodes at least 1")
    if endpoint is None:
        if nnodes > 1:
            raise ValueError(
                f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address, a free port)"
            )
        return Nodes(1, per)
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT")
    if node_rank is None and os.environ.get("SLURM_NODEID", "").isdigit():
        node_rank = int(os.environ["SLURM_NODEID"])
    if node_rank is None:
        raise ValueError(
            f"--nnodes {nnodes} needs --node-rank R on each node (0 on {host}, whose launcher serves the rendezvous; "
            "under srun it is read from SLURM_NODEID)"
        )
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    return Nodes(nnodes, per, endpoint, node_rank)


LAUNCH_FLAGS = ("--nproc", "--nnodes", "--nproc-per-node", "--rdzv-endpoint", "--node-rank")


def without_launch_flags(argv: list[str]) -> list[str]:
    """argv less its launch flags (`--nproc N`, `--nnodes=N`, ...): the re-launched command must not launch again."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in LAUNCH_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in LAUNCH_FLAGS)):
            out.append(a)
    return out
