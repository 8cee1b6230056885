"""Several nodes, simulated on one machine: two `exactrl train --nnodes 2 --nproc-per-node P --rdzv-endpoint
127.0.0.1:PORT --node-rank R` launchers (CPU gloo ranks) run the same job as `exactrl train --nproc 2P`, bit for bit;
a lost rank or launcher stops every rank within the watchdog's bound, in one line that names the rank and its node
(exactrl.distributed.nodes, exactrl.distributed.heartbeat, exactrl.distributed.launch)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from exactrl.distributed import heartbeat
from exactrl.distributed.launch import RankError, failure_report, first_failure
from exactrl.distributed.nodes import Nodes, nodes_from_args, without_launch_flags

from ._runs import REWARD, ROOT, same, small_argv

HOST = socket.gethostname()


def _args(**kw) -> argparse.Namespace:
    base = {"nproc": None, "nnodes": None, "nproc_per_node": None, "rdzv_endpoint": None, "node_rank": None}
    return argparse.Namespace(**{**base, **kw})


def test_node_placement_is_fixed_by_the_command(monkeypatch):
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    n = nodes_from_args(_args(nnodes=2, nproc_per_node=3, rdzv_endpoint="10.0.0.1:29500", node_rank=1))
    assert (n.world_size, n.first_rank) == (6, 3)
    assert n.torchrun_args() == [
        "--nnodes=2", "--nproc-per-node=3", "--node-rank=1", "--rdzv-backend=static",
        "--master-addr=10.0.0.1", "--master-port=29500",
    ]  # fmt: skip
    assert nodes_from_args(_args(nproc=2)) == Nodes(1, 2)
    assert Nodes(1, 2).torchrun_args() == ["--standalone", "--nproc-per-node=2"]
    assert nodes_from_args(_args()) is None
    monkeypatch.setenv("SLURM_NODEID", "1")  # srun: the node's place comes from Slurm
    assert nodes_from_args(_args(nnodes=2, nproc_per_node=1, rdzv_endpoint="h:1")).node_rank == 1
    monkeypatch.delenv("SLURM_NODEID")
    for kw, said in [
        ({"nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": "h:1"}, "needs --node-rank R"),
        ({"nnodes": 2, "nproc_per_node": 1, "node_rank": 0}, "needs --rdzv-endpoint"),
        ({"nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": "h", "node_rank": 0}, "is not HOST:PORT"),
        ({"nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": "h:1", "node_rank": 2}, "outside 0..1"),
        ({"nnodes": 2, "nproc": 2}, "give --nproc-per-node"),
        ({"node_rank": 0}, "--node-rank needs --nnodes"),
    ]:
        with pytest.raises(ValueError, match=said):
            nodes_from_args(_args(**kw))
    argv = [
        "train",
        "c.toml",
        "--nnodes",
        "2",
        "--nproc-per-node=1",
        "--rdzv-endpoint",
        "h:1",
        "--node-rank",
        "0",
    ]
    assert without_launch_flags(argv + ["--nproc", "2"]) == ["train", "c.toml"]


def test_a_killed_rank_is_the_cause_before_the_ranks_that_lost_it():
    """The generator killed by SIGKILL (it writes nothing) while the trainers fail in a collective with gloo's
    "Connection closed by peer": the report names the killed rank and its signal, in one line."""
    lost = {
        r: RankError(r, 10.0 + r, f"exactrl: rank {r} ({HOST}) lost a peer: ...", 1, "lost") for r in (0, 1)
    }
    rank, status, text = first_failure({0: 1, 1: 1, 2: -int(signal.SIGKILL)}, lost)
    assert (rank, status, text) == (2, 137, None)
    assert failure_report(rank, status, text, HOST) == (
        f"exactrl: rank 2 ({HOST}) was killed by SIGKILL (exit status 137); the other ranks were stopped"
    )
    # An error of a rank's own comes before both; among ranks that lost a peer, the earliest line (the watchdog's).
    own = {**lost, 1: RankError(1, 12.0, "exactrl train (rank 1): error: refused", 2)}
    assert first_failure({0: 1, 1: 2, 2: -int(signal.SIGKILL)}, own)[0] == 1
    assert first_failure({0: 1, 1: -int(signal.SIGTERM)}, lost) == (0, 1, lost[0].text)


_TMPDIRS: dict[str, str] = {}


def _env(tmp: Path, name: str) -> dict[str, str]:
    # Each launcher's own temporary folder (where its ranks leave their pids): a short one, a socket path under
    # pytest's tmp_path is too long for AF_UNIX.
    _TMPDIRS[name] = tempfile.mkdtemp(prefix="exactrl-test-")
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=_TMPDIRS[name])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _start(tmp: Path, name: str, argv: list[str]) -> subprocess.Popen:
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "exactrl.cli", *argv], cwd=tmp, env=_env(tmp, name), stdout=log, stderr=log
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(tmp: Path, tag: str, argv: list[str], per_node: int) -> list[subprocess.Popen]:
    port = _free_port()
    flags = ["--nnodes", "2", "--nproc-per-node", str(per_node), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return [_start(tmp, f"{tag}-node{r}", [*argv, *flags, "--node-rank", str(r)]) for r in (0, 1)]


def _finish(tmp: Path, procs: dict[str, subprocess.Popen], timeout: float) -> None:
    for name, p in procs.items():
        code = p.wait(timeout=timeout)
        assert code == 0, f"{name} exited {code}:\n" + (tmp / f"{name}.log").read_text()[-4000:]


def _equal_runs(tmp: Path, tag: str, extra: list[str], per_node: int) -> None:
    (tmp / "reward.py").write_text(REWARD)
    one = _start(tmp, f"{tag}-one", [*small_argv(tmp, f"{tag}-one", 2, *extra), "--nproc", str(2 * per_node)])
    _finish(tmp, {f"{tag}-one": one}, 400)
    node0, node1 = _nodes(tmp, tag, small_argv(tmp, f"{tag}-two", 2, *extra), per_node)
    _finish(tmp, {f"{tag}-node0": node0, f"{tag}-node1": node1}, 400)
    said = (tmp / f"{tag}-node1.log").read_text()
    assert f"node 1 of 2 (ranks {per_node}..{2 * per_node - 1} of {2 * per_node}" in said
    assert same(tmp / f"{tag}-one", tmp / f"{tag}-two")


def test_two_nodes_equal_one_node_at_the_same_world_size(tmp_path):
    """Colocated, world size 2 (one rank on each node) against `--nproc 2`: every logged metric (timings aside) and
    the final weights, torch.equal."""
    _equal_runs(tmp_path, "co", [], 1)


@pytest.mark.extended
def test_a_generator_on_the_other_node_equals_one_node(tmp_path):
    """distributed.generator_ranks = 1 of 2: the trainer on node 0, the generator (the last rank) on node 1."""
    _equal_runs(tmp_path, "gen", ["distributed.generator_ranks=1"], 1)


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


def _rank_pids(tmp: Path, name: str) -> list[int]:
    return [int(p.read_text()) for p in Path(_TMPDIRS[name]).glob("exactrl-ranks-*/pid-*")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _lose_node1(tmp: Path, tag: str, kill) -> tuple[float, str, str]:
    """Two nodes of one rank training; once both logged a step, `kill(launcher of node 1)`; returns the seconds
    until every process of both nodes is gone and each node's stderr."""
    (tmp / "reward.py").write_text(REWARD)
    procs = _nodes(tmp, tag, small_argv(tmp, tag, 400), 1)
    logs = [tmp / f"{tag}-node{r}.log" for r in (0, 1)]
    deadline = time.monotonic() + 300
    while "step    2 |" not in logs[0].read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs[0].read_text()[
            -3000:
        ]
        time.sleep(0.5)
    ranks = _rank_pids(tmp, f"{tag}-node0") + _rank_pids(tmp, f"{tag}-node1")
    assert len(ranks) == 2
    t = time.monotonic()
    kill(procs[1].pid)
    for p in procs:
        p.wait(timeout=120)
    while any(_alive(pid) for pid in ranks):  # no rank keeps training orphaned
        assert time.monotonic() - t < 120
        time.sleep(0.2)
    secs = time.monotonic() - t
    print(f"{tag}: every process of both nodes gone {secs:.1f} s after the kill")
    return secs, logs[0].read_text(), logs[1].read_text()


@pytest.mark.extended
def test_a_killed_rank_on_another_node_stops_the_run_within_the_bound(tmp_path):
    """Rank 1 (node 1) killed by SIGKILL: node 1 says so; node 0 stops within the watchdog's bound
    (LOST_AFTER_S + 2 beats, plus the launchers' own shutdown) and names rank 1 and its node."""

    def kill_rank(launcher: int) -> None:
        os.kill(_rank_pids(tmp_path, "rank-node1")[0], signal.SIGKILL)

    secs, said0, said1 = _lose_node1(tmp_path, "rank", kill_rank)
    assert secs < heartbeat.LOST_AFTER_S + 2 * heartbeat.BEAT_S + 10, secs
    assert said1.strip().splitlines()[-1] == (
        f"exactrl: rank 1 ({HOST}) was killed by SIGKILL (exit status 137); the other ranks were stopped"
    )
    last = said0.strip().splitlines()[-1]
    assert last.startswith(f"exactrl: rank 1 ({HOST}) stopped answering for "), said0[-3000:]
    assert "Traceback" not in said0 + said1


@pytest.mark.extended
def test_a_killed_node_launcher_stops_its_rank_and_the_other_node_in_seconds(tmp_path):
    """Node 1's torchrun agent killed by SIGKILL (its rank would train on, orphaned): the rank sees its launcher
    gone and stops, and node 0 reads why from the rendezvous store at its next beat."""

    def kill_agent(launcher: int) -> None:
        (agent,) = _children(launcher)
        os.kill(agent, signal.SIGKILL)

    secs, said0, said1 = _lose_node1(tmp_path, "agent", kill_agent)
    assert secs < 4 * heartbeat.BEAT_S + 10, secs
    assert (
        said1.strip().splitlines()[-1].startswith(f"exactrl: rank 1 ({HOST}): its launcher (torchrun's agent")
    )
    last = said0.strip().splitlines()[-1]
    assert last.startswith(f"exactrl: rank 1 ({HOST}) failed: its launcher (torchrun's agent, pid "), said0[
        -3000:
    ]
    assert last.endswith(f"is gone; rank 0 ({HOST}) stopped")
    assert "Traceback" not in said0 + said1
