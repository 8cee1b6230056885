"""Starting torchrun from `exactrl ... --nproc N`, and signals on their way to the ranks.

A scheduler stops a job with SIGTERM (Ctrl-C is SIGINT) and kills it a grace period later. Each rank then
finishes its step and checkpoints (`exactrl.train.signals.StopFlag`); torchrun's agent passes the signal it gets on
to every rank and kills them after its own shutdown timeout (`--shutdown-timeout`, TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
30 s by default: set it above a step plus a checkpoint). The launcher below makes sure the agent gets the signal
the `exactrl` process got, once: the agent runs in a session of its own (a terminal's Ctrl-C, or a signal to the
launcher's process group, reaches the launcher alone), and the launcher forwards the first SIGINT / SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORWARDED = (signal.SIGINT, signal.SIGTERM)


def call_forwarding_signals(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run `cmd` (torchrun) to its end and return its exit status (128 + the signal after a forwarded stop, as
    one process exits after it), handing it the first SIGINT and the first
    SIGTERM this process receives. Without this, a SIGTERM to the launcher alone (Kubernetes signals a pod's
    first process) killed it and left torchrun and its ranks running unaware, and a Ctrl-C made
    `subprocess.call` SIGKILL torchrun's agent before any rank could checkpoint."""
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)
    sent: set[int] = set()

    def forward(signum: int, frame: Any) -> None:
        if signum not in sent and proc.poll() is None:
            sent.add(signum)
            proc.send_signal(signum)

    old = {}
    for sig in FORWARDED:
        try:
            old[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: the signals stay with whoever owns them
            break
    try:
        rc = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    # The ranks stopped as asked (each checkpointed, exiting 128 + signal); torchrun reports the signal it got as a
    # failure of its own. Exit as one process stopped by that signal does.
    if sent and rc != 0:
        return 128 + int(signal.SIGTERM if signal.SIGTERM in sent else signal.SIGINT)
    return rc


# --- One error, once -------------------------------------------------------------------------------------------
# torchrun's agent reports a failed rank with two copies of a ChildFailedError traceback (40-50 lines) after the
# rank's own message, and every rank that hits the same refusal prints it. Under `exactrl ... --nproc N` the ranks
# write their error to a file of their own in RANK_ERRORS_ENV's folder instead of printing it; the agent runs in
# `agent_main` below, which keeps torchrun's tracebacks and log lines to itself and prints the first failing rank's
# error once, then exits with that rank's exit status. The ranks' stdout and stderr stream as before (inherited).
RANK_ERRORS_ENV = "EXACTRL_RANK_ERRORS"


@dataclass
class RankError:
    """What a rank wrote before it failed: `time` (seconds since the epoch) orders the ranks' failures; `status`
    is the exit status the rank meant to exit with (None where it did not say)."""

    rank: int
    time: float
    text: str
    status: int | None = None


def write_rank_error(text: str, status: int) -> bool:
    """Under exactrl's launcher: leave this rank's error (one line, or a traceback) and the exit status it is about
    to exit with for the launcher to print once, and return True. False where no launcher asked for it (a plain
    torchrun, one process): print it yourself. The status travels in the record because the process may not get
    to exit with it: once a peer has crashed, torchrun stops the ranks still tearing down with SIGTERM."""
    folder, rank = os.environ.get(RANK_ERRORS_ENV), os.environ.get("RANK")
    if not folder or rank is None:
        return False
    record = {"rank": int(rank), "time": time.time(), "text": text, "status": int(status)}
    tmp = Path(folder) / f"rank-{rank}.json.tmp"
    try:
        tmp.write_text(json.dumps(record))
        tmp.replace(tmp.with_suffix(""))  # whole or absent: the launcher may read it as this rank exits
    except OSError:
        return False
    return True


def read_rank_errors(folder: str | Path) -> dict[int, RankError]:
    """The errors the ranks left in `folder` (write_rank_error), by rank."""
    out: dict[int, RankError] = {}
    for p in sorted(Path(folder).glob("rank-*.json")):
        try:
            d = json.loads(p.read_text())
            status = d.get("status")
            out[int(d["rank"])] = RankError(
                int(d["rank"]), float(d["time"]), str(d["text"]), None if status is None else int(status)
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a file torn by a kill: the rank's exit status still speaks
    return out


def shell_status(exitcode: int) -> int:
    """A process's exit status as a shell reports it: 128 + N for one killed by signal N (torchrun says -N)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def first_failure(exitcodes: dict[int, int], errors: dict[int, RankError]) -> tuple[int, int, str | None]:
    """(rank, exit status, its error or None) of the failure to report, from the failed ranks' exit codes
    (torchrun's: -N for signal N) and the errors they wrote.

    A rank that wrote an error is the cause before one that did not (a rank that fails while its peers wait in a
    collective writes first; the peers' own errors, "connection closed by peer", come later): the earliest error
    wins, with the status it wrote (torchrun may have stopped it with SIGTERM while it tore down). Without any, a rank that exited on its own (a verdict such as parity's exit 1, a crash by SIGSEGV) before
    one that torchrun stopped with SIGTERM because a peer had failed; then the lowest rank."""
    written = [r for r in exitcodes if r in errors]
    if written:
        rank = min(written, key=lambda r: (errors[r].time, r))
        said = errors[rank].status
        return rank, shell_status(exitcodes[rank]) if said is None else said, errors[rank].text
    rank = min(exitcodes, key=lambda r: (exitcodes[r] == -signal.SIGTERM, r))
    return rank, shell_status(exitcodes[rank]), None


def failure_report(rank: int, status: int, text: str | None) -> str | None:
    """The launcher's one report of a failed launch, or None where the ranks have said everything themselves (a
    rank that exited with a status of its own and no error: parity's verdict, train's exit 3)."""
    if text is not None:
        return text
    if status > 128:
        try:
            name = signal.Signals(status - 128).name
        except ValueError:
            name = f"signal {status - 128}"
        return (
            f"exactrl: rank {rank} was killed by {name} (exit status {status}); the other ranks were stopped"
        )
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
        report = failure_report(rank, status, text)
        if report is not None:
            print(report, file=sys.stderr, flush=True)
        return status or 1
    except SignalException as e:  # the launcher forwarded a SIGINT / SIGTERM: the ranks were stopped with it
        return 128 + int(e.sigval)
    return 0


def launch(nproc: int, module: str, argv: list[str]) -> int:
    """Run `python -m module argv` on `nproc` local ranks under torchrun (standalone: one node, a free port) and
    return the exit status to exit with: 0, or the first failing rank's, whose error is printed once."""
    cmd = [sys.executable, "-m", "exactrl.distributed.launch", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", module, *argv]
    threads = ""
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:  # torchrun's banner about it is kept quiet
        threads = " (OMP_NUM_THREADS=1 on each rank, torchrun's default: set it to change that)"
    shown = " ".join(["torchrun", *cmd[3:]])
    print(f"exactrl: launching {nproc} ranks: {shown}{threads}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="exactrl-ranks-") as folder:
        env = {**os.environ, RANK_ERRORS_ENV: folder}
        return call_forwarding_signals(
            cmd, env=env
        )  # SIGTERM / Ctrl-C reach the ranks, which checkpoint and stop


if __name__ == "__main__":
    sys.exit(agent_main(sys.argv[1:]))


def _without_nproc(argv: list[str]) -> list[str]:
    """argv less its `--nproc N` / `--nproc=N` (the re-launched command must not launch again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Run `exactrl <argv>` on `nproc` local ranks under torchrun and return the status to exit with: torchrun's
    agent stops every rank as soon as one fails, and the first failing rank's error is printed once
    (`launch`). Check the command first (`exactrl.cli.check_before_launch`): what fails there starts nothing."""
    from exactrl.distributed.env import under_torchrun  # torch, imported only by a command that launches

    if under_torchrun():
        raise ValueError("--nproc under torchrun: torchrun has started the ranks already; drop --nproc")
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    return launch(nproc, "exactrl.cli", _without_nproc(argv))
