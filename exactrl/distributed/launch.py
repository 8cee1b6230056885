"""Starting torchrun from `exactrl ... --nproc N`, and signals on their way to the ranks.

A scheduler stops a job with SIGTERM (Ctrl-C is SIGINT) and kills it a grace period later. Each rank then
finishes its step and checkpoints (`exactrl.train.signals.StopFlag`); torchrun's agent passes the signal it gets on
to every rank and kills them after its own shutdown timeout (`--shutdown-timeout`, TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
30 s by default: set it above a step plus a checkpoint). The launcher below makes sure the agent gets the signal
the `exactrl` process got, once: the agent runs in a session of its own (a terminal's Ctrl-C, or a signal to the
launcher's process group, reaches the launcher alone), and the launcher forwards the first SIGINT / SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from exactrl.distributed.heartbeat import (  # the rank's side of the reports this launcher reads
    LAUNCHER_PID_ENV,
    RANK_ERRORS_ENV,
    RankError,
    read_rank_errors,
)
from exactrl.distributed.nodes import Nodes

FORWARDED = (signal.SIGINT, signal.SIGTERM)


def call_forwarding_signals(
    cmd: list[str], env: dict[str, str] | None = None, pids: Path | None = None
) -> int:
    """Run `cmd` (torchrun) to its end and return its exit status (128 + the signal after a forwarded stop, as
    one process exits after it), handing it the first SIGINT and the first SIGTERM this process receives. Without
    this, a SIGTERM to the launcher alone (Kubernetes signals a pod's first process) killed it and left torchrun
    and its ranks running unaware, and a Ctrl-C made `subprocess.call` SIGKILL torchrun's agent before any rank
    could checkpoint.

    A second signal (Ctrl-C again) aborts: the agent and every rank that left its pid in `pids` (`note_rank_pid`)
    are killed at once, without a checkpoint. The ranks cannot tell a second Ctrl-C from the agent's copy of the
    first, so the launcher does it."""
    sent: set[int] = set()
    aborted: list[int] = []
    early: list[int] = []  # a signal before the agent started: handed to it as soon as it has
    proc: subprocess.Popen | None = None

    def forward(signum: int, frame: Any) -> None:
        if proc is None:
            early.append(signum)
            return
        if proc.poll() is not None:
            return
        if not sent:
            sent.add(signum)
            proc.send_signal(signum)
            return
        aborted.append(signum)
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(
            f"\nexactrl: {what} again: killing the ranks without a checkpoint (--resume continues from the last one)",
            file=sys.stderr,
            flush=True,
        )
        kill_ranks(pids)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    old = {}
    for sig in FORWARDED:
        try:
            old[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: the signals stay with whoever owns them
            break
    try:
        proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        for signum in early:
            forward(signum, None)
        rc = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if aborted:
        return 128 + int(aborted[-1])
    # The ranks stopped as asked (each checkpointed, exiting 128 + signal); torchrun reports the signal it got as a
    # failure of its own. Exit as one process stopped by that signal does.
    if sent and rc != 0:
        return 128 + int(signal.SIGTERM if signal.SIGTERM in sent else signal.SIGINT)
    return rc


def kill_ranks(folder: Path | None) -> None:
    """SIGKILL every rank whose pid is in `folder` (note_rank_pid)."""
    for p in sorted(folder.glob("pid-*")) if folder is not None else []:
        try:
            os.kill(int(p.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def shell_status(exitcode: int) -> int:
    """A process's exit status as a shell reports it: 128 + N for one killed by signal N (torchrun says -N)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def first_failure(exitcodes: dict[int, int], errors: dict[int, RankError]) -> tuple[int, int, str | None]:
    """(rank, exit status, its error or None) of the failure to report, from the failed ranks' exit codes
    (torchrun's: -N for signal N) and the errors they wrote.

    The cause, in this order: a rank that wrote an error of its own (the earliest, with the status it wrote:
    torchrun may have stopped it with SIGTERM while it tore down); a rank that died without a word (killed by a
    signal other than torchrun's SIGTERM, or an exit of its own such as parity's verdict), the lowest first; a rank
    that wrote that it lost a peer (the earliest: its watchdog's line names the peer); then the lowest rank."""

    def order(r: int) -> tuple[int, float, int]:
        e = errors.get(r)
        if e is not None and e.kind == "error":
            return (0, e.time, r)
        if e is None and exitcodes[r] != -signal.SIGTERM:
            return (1, 0.0, r)
        if e is not None:
            return (2, e.time, r)
        return (3, 0.0, r)

    rank = min(exitcodes, key=order)
    e = errors.get(rank)
    if e is not None:
        return rank, shell_status(exitcodes[rank]) if e.status is None else e.status, e.text
    return rank, shell_status(exitcodes[rank]), None


def failure_report(rank: int, status: int, text: str | None, host: str | None = None) -> str | None:
    """The launcher's one report of a failed launch, or None where the ranks have said everything themselves (a
    rank that exited with a status of its own and no error: parity's verdict, train's exit 3). `host`: the node of
    the failed rank (the launcher's own)."""
    if text is not None:
        return text
    if status > 128:
        try:
            name = signal.Signals(status - 128).name
        except ValueError:
            name = f"signal {status - 128}"
        where = f"rank {rank}" + (f" ({host})" if host else "")
        return f"exactrl: {where} was killed by {name} (exit status {status}); the other ranks were stopped"
    return None


def _quiet_agent_logs() -> None:
    """Keep torchrun's agent from logging each failed rank (`failed (exitcode: 1) local_rank: 0 ...`) and each
    SIGTERM it sends the others (the launcher reports the failure itself), and its OMP_NUM_THREADS banner (the
    launcher's first line says it). Its loggers set their own level when
    created (torch.distributed.elastic.utils.logging.get_logger), so each one is set, not just the parent."""
    import logging

    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def agent_main(argv: list[str]) -> int:
    """torchrun (`torch.distributed.run`'s own argument parsing and agent), reporting a failure once: the first
    failing rank's error (`first_failure`) on stderr, and that rank's exit status as this process's."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _quiet_agent_logs()
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        folder = os.environ.get(RANK_ERRORS_ENV)
        errors = read_rank_errors(folder) if folder else {}
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        rank, status, text = first_failure(codes, errors)
        report = failure_report(rank, status, text, socket.gethostname())
        if report is not None:
            print(report, file=sys.stderr, flush=True)
        return status or 1
    except SignalException as e:  # the launcher forwarded a SIGINT / SIGTERM: the ranks were stopped with it
        return 128 + int(e.sigval)
    return 0


def launch(nodes: Nodes, module: str, argv: list[str]) -> int:
    """Run `python -m module argv` on this node's ranks of `nodes` under torchrun (one node: standalone, a free port;
    several: static rendezvous, exactrl.distributed.nodes) and return the exit status to exit with: 0, or the first
    failing rank's, whose error is printed once."""
    cmd = [sys.executable, "-m", "exactrl.distributed.launch", *nodes.torchrun_args()]
    cmd += ["-m", module, *argv]
    threads = ""
    if (
        nodes.world_size > 1 and "OMP_NUM_THREADS" not in os.environ
    ):  # torchrun's banner about it is kept quiet
        threads = " (OMP_NUM_THREADS=1 on each rank, torchrun's default: set it to change that)"
    shown = " ".join(["torchrun", *cmd[3:]])
    print(f"exactrl: launching {nodes.describe()}: {shown}{threads}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="exactrl-ranks-") as folder:
        env = {**os.environ, RANK_ERRORS_ENV: folder, LAUNCHER_PID_ENV: str(os.getpid())}
        # SIGTERM / Ctrl-C reach the ranks, which checkpoint and stop; a second one kills them
        return call_forwarding_signals(cmd, env=env, pids=Path(folder))


def launch_torchrun(nodes: Nodes | int, argv: list[str]) -> int:
    """Run `exactrl <argv>` on this node's ranks of `nodes` (Nodes, or N: N local ranks) under torchrun and return
    the status to exit with: torchrun's agent stops every rank as soon as one fails, and the first failing rank's
    error is printed once (`launch`). Check the command first (`exactrl.cli.check_before_launch`): what fails there
    starts nothing."""
    from exactrl.distributed.env import under_torchrun  # torch, imported only by a command that launches
    from exactrl.distributed.nodes import without_launch_flags

    if isinstance(nodes, int):  # --nproc N: one node
        nodes = Nodes(1, nodes)
    if under_torchrun():
        raise ValueError("--nproc under torchrun: torchrun has started the ranks already; drop --nproc")
    if nodes.nproc_per_node < 1:
        raise ValueError(f"--nproc must be at least 1, got {nodes.nproc_per_node}")
    return launch(nodes, "exactrl.cli", without_launch_flags(argv))


if __name__ == "__main__":
    sys.exit(agent_main(sys.argv[1:]))
