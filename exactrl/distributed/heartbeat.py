"""A lost rank or node stops the run in seconds, in one line that names it.

A collective waits up to PROCESS_GROUP_TIMEOUT_S (30 minutes) for a peer, and on NCCL a dead peer is caught by nothing
sooner; a rank whose launcher (torchrun's agent) was killed keeps training, orphaned, while its peers wait. So each
rank of a run under torchrun runs a watchdog thread that, every BEAT_S:
- counts one beat in the rendezvous store (the TCPStore at MASTER_ADDR:MASTER_PORT every rank joined: a connection
  of the thread's own, so it never waits behind the main thread's use of the store);
- reads every rank's count: a rank whose count has not moved for LOST_AFTER_S (and that did not finish) is lost;
  a rank that fails says why in the store first (`announce`, or its watchdog when its launcher is gone): it is lost
  after FAILED_SILENT_S of silence (its process gone; while it lives, writing its report, nothing is cut short),
  and its reason is what the others report;
- checks that its own launcher is alive (its parent process, torchrun's agent, and exactrl's launcher).
On a lost peer, an unreachable store or a dead launcher the rank leaves its one line for the launcher (or prints
it where there is none) and exits at once (status 1), whatever its main thread is waiting in; torchrun's agent then
stops the node's other ranks. Bound: a lost rank stops every other rank within LOST_AFTER_S + 2 * BEAT_S
(17 s); a rank that said why it failed, or whose launcher died, within FAILED_SILENT_S + 3 * BEAT_S (5 s) of its
exit; an unreachable store within 2 * BEAT_S.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

BEAT_S = 1.0
LOST_AFTER_S = float(os.environ.get("EXACTRL_LOST_AFTER_S", "15"))
FAILED_SILENT_S = 2.0  # the silence that ends a rank that said it fails (`announce`)
STORE_TIMEOUT_S = 10.0
LAUNCHER_PID_ENV = "EXACTRL_LAUNCHER_PID"  # set by exactrl's launcher: its own pid, watched by every rank
# A restarted attempt (torchrun --max-restarts) keeps the agent's store: its keys are its own.
PREFIX = f"exactrl/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
DONE = 1 << 40  # added to a rank's count when it finishes: its silence from then on is no loss

_watchdog: Watchdog | None = None


class Watchdog(threading.Thread):
    def __init__(self, rank: int, world_size: int, host: str, port: int) -> None:
        super().__init__(name="exactrl-watchdog", daemon=True)
        self.rank, self.world_size, self.addr = rank, world_size, (host, port)
        self.parent = os.getppid()
        launcher = os.environ.get(LAUNCHER_PID_ENV, "")
        self.launcher = int(launcher) if launcher.isdigit() else None
        self.stopped = threading.Event()
        self.store: Any = None  # torch.distributed.TCPStore once connected (run)

    def _connect(self):
        import torch.distributed as dist

        return dist.TCPStore(
            self.addr[0], self.addr[1], is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S)
        )

    def run(self) -> None:
        try:
            self.store = self._connect()
            self.store.set(f"{PREFIX}host/{self.rank}", socket.gethostname())
            self.store.add(f"{PREFIX}beat/{self.rank}", 1)
        except Exception as e:  # the store's client raises RuntimeError subclasses
            self._halt(f"rank {self.rank} could not reach the rendezvous store at {self._endpoint()}: {e}")
            return
        beats = [f"{PREFIX}beat/{r}" for r in range(self.world_size)]
        seen: dict[int, tuple[int, float]] = {}
        started, failures, said = False, 0, set()
        while not self.stopped.wait(BEAT_S):
            why = self._launcher_gone()
            if why:
                self._announce(why)  # the other nodes read this now instead of 15 s of silence
                self._halt(f"rank {self.rank} ({socket.gethostname()}): {why}; rank {self.rank} stopped")
                return
            try:
                self.store.add(beats[self.rank], 1)
                # Every rank's count in one round trip (world_size requests a second on the store in all, each
                # of world_size keys), once every rank has beaten: a key read before it exists would wait. Until
                # then nobody is judged (the process group was formed, so every rank's first beat is a second away).
                started = started or self.store.check(beats)
                counts = [int(v) for v in self.store.multi_get(beats)] if started else []
                now_failures = self.store.add(f"{PREFIX}failures", 0)
            except Exception as e:
                if self.stopped.is_set():
                    return
                self._halt(
                    f"rank {self.rank} ({socket.gethostname()}) lost the rendezvous store at {self._endpoint()} "
                    f"(its host, node 0's launcher or rank 0, is gone or overloaded): "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                )
                return
            # A rank that said why it fails is lost once it stops beating for FAILED_SILENT_S (its process is gone);
            # while it lives (writing its report, its record) nothing is cut short. Any other rank after
            # LOST_AFTER_S of silence. Who said so is read again only when the count of such ranks grows.
            if now_failures != failures:
                failures = now_failures
                said = {r for r in range(self.world_size) if r != self.rank and self._failed(r)}
            now = time.monotonic()
            for r, n in enumerate(counts):
                if r == self.rank or n >= DONE:
                    continue
                last = seen.get(r)
                if last is None or last[0] != n:
                    seen[r] = (n, now)
                elif now - last[1] > (FAILED_SILENT_S if r in said else LOST_AFTER_S):
                    self._halt(self._lost(r, now - last[1]))
                    return

    def _endpoint(self) -> str:
        return f"{self.addr[0]}:{self.addr[1]}"

    def _launcher_gone(self) -> str | None:
        if os.getppid() != self.parent:
            return f"its launcher (torchrun's agent, pid {self.parent}) is gone"
        if self.launcher is not None:
            try:
                os.kill(self.launcher, 0)
            except ProcessLookupError:
                return f"its launcher (exactrl, pid {self.launcher}) is gone"
            except PermissionError:
                pass
        return None

    def _failed(self, peer: int) -> bool:
        return self.store.check([f"{PREFIX}failed/{peer}"])

    def _lost(self, peer: int, silent_s: float) -> str:
        host = said = None
        try:
            host = self.store.get(f"{PREFIX}host/{peer}").decode()
            if self.store.check([f"{PREFIX}failed/{peer}"]):
                said = self.store.get(f"{PREFIX}failed/{peer}").decode()
        except Exception:  # the names are a courtesy
            pass
        where = f"rank {peer} ({host or 'its node unknown'})"
        if said:
            return f"{where} failed: {said}; rank {self.rank} ({socket.gethostname()}) stopped"
        return (
            f"{where} stopped answering for {silent_s:.0f} s (its process or its node is gone); "
            f"rank {self.rank} ({socket.gethostname()}) stopped"
        )

    def _announce(self, what: str) -> None:
        try:
            self.store.set(f"{PREFIX}failed/{self.rank}", what)
            self.store.add(f"{PREFIX}failures", 1)
        except Exception:  # the store may be what is gone
            pass

    def _halt(self, what: str) -> None:  # not `_stop`: threading.Thread has its own, called at fork and join
        import multiprocessing

        self.stopped.set()
        for (
            child
        ) in multiprocessing.active_children():  # reward workers: they would outlive the rank, and complain
            child.kill()
        text = f"exactrl: {what}"
        if not write_rank_error(text, 1, kind="lost") or os.getppid() != self.parent:
            print(text, file=sys.stderr, flush=True)
        os._exit(1)  # the main thread may be inside a collective that would wait 30 minutes


def start(rank: int, world_size: int) -> Watchdog | None:
    """Start this rank's watchdog (under torchrun, several ranks; None otherwise)."""
    global _watchdog
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size < 2 or not addr or not (port or "").isdigit() or _watchdog is not None:
        return _watchdog
    _watchdog = Watchdog(rank, world_size, addr, int(port or 0))
    _watchdog.start()
    return _watchdog


def announce(text: str) -> None:
    """Tell the other ranks why this rank is about to fail (the first line of `text`), for their report."""
    w = _watchdog
    if w is None or w.store is None:
        return
    try:
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        gist = lines[-1] if len(lines) > 1 and any(ln.startswith("Traceback") for ln in lines) else lines[0]
        w.store.set(f"{PREFIX}failed/{w.rank}", gist[:300])
        w.store.add(f"{PREFIX}failures", 1)
    except Exception:  # the rank fails anyway
        pass


def finish() -> None:
    """This rank finished its work: its silence from now on is no loss. Stops the thread."""
    global _watchdog
    w, _watchdog = _watchdog, None
    if w is None:
        return
    w.stopped.set()
    try:
        if w.store is not None:
            w.store.add(f"{PREFIX}beat/{w.rank}", DONE)
    except Exception:
        pass


def running() -> bool:
    return _watchdog is not None and _watchdog.is_alive()


def await_verdict() -> None:
    """A collective failed because a peer is gone: give the watchdog the time to find which (it then exits this
    process with its line). Returns if it finds nothing in that time."""
    w = _watchdog
    if w is not None and w is not threading.current_thread():  # the watchdog itself reports, then exits
        w.join(LOST_AFTER_S + 3 * BEAT_S)


# --- The rank's side of exactrl's launcher (exactrl.distributed.launch reads what these leave) ---------------
def under_exactrl_launcher() -> bool:
    """Whether exactrl's launcher started this rank (`--nproc`, `--nnodes`): a second Ctrl-C then aborts."""
    return bool(os.environ.get(RANK_ERRORS_ENV))


def note_rank_pid() -> None:
    """Under exactrl's launcher: leave this rank's pid for it (a second Ctrl-C kills the ranks)."""
    folder, rank = os.environ.get(RANK_ERRORS_ENV), os.environ.get("LOCAL_RANK")
    if folder and rank is not None:
        try:
            (Path(folder) / f"pid-{rank}").write_text(str(os.getpid()))
        except OSError:
            pass


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
    kind: str = "error"  # "lost": the rank stopped because it lost a peer (the cause is elsewhere)


# A collective's error when a peer is gone (gloo, NCCL, the store): the rank that says it is not the cause.
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|DistNetworkError"
)


def write_rank_error(text: str, status: int, kind: str = "error") -> bool:
    """Under exactrl's launcher: leave this rank's error (one line, or a traceback) and the exit status it is about
    to exit with for the launcher to print once, and return True. False where no launcher asked for it (a plain
    torchrun, one process): print it yourself. The status travels in the record because the process may not get
    to exit with it: once a peer has crashed, torchrun stops the ranks still tearing down with SIGTERM.

    kind "lost" (or an error that says a peer is gone, PEER_LOST) marks a rank that failed because another did: the
    launcher names the cause before it. Such an error is kept to one line, and the rank first gives its watchdog
    the time to find which peer is gone (below), whose line then replaces this one. An error
    of the rank's own is announced to the other ranks, whose reports name it."""
    if kind == "error" and PEER_LOST.search(text):
        kind = "lost"
        said = next((ln.strip() for ln in text.splitlines() if PEER_LOST.search(ln)), "")
        text = f"exactrl: rank {os.environ.get('RANK')} ({socket.gethostname()}) lost a peer: {said[:200]}"
    elif kind == "error":
        announce(text)
    folder, rank = os.environ.get(RANK_ERRORS_ENV), os.environ.get("RANK")
    if not folder or rank is None:
        if kind == "lost" and running():
            await_verdict()
        return False
    record = {"rank": int(rank), "time": time.time(), "text": text, "status": int(status), "kind": kind}
    tmp = Path(folder) / f"rank-{rank}.json.tmp"
    try:
        tmp.write_text(json.dumps(record))
        tmp.replace(tmp.with_suffix(""))  # whole or absent: the launcher may read it as this rank exits
    except OSError:
        return False
    if kind == "lost" and running() and threading.current_thread() is threading.main_thread():
        await_verdict()
    return True


def read_rank_errors(folder: str | Path) -> dict[int, RankError]:
    """The errors the ranks left in `folder` (write_rank_error), by rank."""
    out: dict[int, RankError] = {}
    for p in sorted(Path(folder).glob("rank-*.json")):
        try:
            d = json.loads(p.read_text())
            status = d.get("status")
            out[int(d["rank"])] = RankError(
                int(d["rank"]),
                float(d["time"]),
                str(d["text"]),
                None if status is None else int(status),
                str(d.get("kind", "error")),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a file torn by a kill: the rank's exit status still speaks
    return out
