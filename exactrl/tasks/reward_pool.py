"""Reward calls in worker processes, so that a hung call can be stopped: its worker is killed and replaced.

A thread cannot be stopped (a busy loop in one keeps running and keeps taking the GIL), a process can. Workers are
started with `forkserver` where the platform has it (else `spawn`), never by a plain `fork`: the trainer's process
may hold CUDA state, which a forked child must not touch. Each worker imports the user's reward functions once,
when it starts, and says it is ready; only then does a call's clock start, so a slow `import` in a reward file does
not eat into the first call's timeout. A child of `forkserver` or `spawn` re-runs the parent's main module before
its target (Python 3.11 does not preload it in the fork server): under `exactrl train` that is exactrl.cli, torch
and the whole package, 2-3 s a worker on a 2-core machine. Functions named by spec ("file.py:fn", "module:fn") do
not need it, so their workers start without it (`_main_not_rerun`: about 0.2 s); a function passed by value
(pickled by reference, perhaps to the script that was run, `__main__`) keeps the re-run it may need.

One request per worker at a time. Per-sample calls go in chunks (one message for many calls: a pipe round trip
per call cost about 250 us, a chunk about 40 us per call); the worker writes the start time of its current call
into memory it shares with the parent, so the timeout still holds per call. A call that runs past its limit is
stopped with SIGKILL; the calls of its chunk that had not finished go to a fresh worker (calls that had finished
are run again: their results died with the worker). Results are converted to a float (or to a description of what
went wrong) inside the worker, so whatever a function returns never has to be pickled back.

Messages on a worker's pipe, parent -> worker: `(kind, index, payload)` with kind "calls" (a list of samples,
called one by one), "batch" (lists, for batched functions) or "gather" (a list of samples for an `async def`
per-sample function, run concurrently on one event loop), or None to stop. Worker -> parent: `("ready", [flags or
error per function])` once, then one `("ok", [(score, problem), ...])` per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import multiprocessing
import numbers
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from exactrl.tasks import verl_score
from exactrl.tasks.worker_loop import enter_worker, serve

# How long a worker may take to start and import the reward functions (a reward file may import heavy packages).
START_TIMEOUT_S = 120.0
# An async per-sample call has its own `asyncio.wait_for` limit; the worker gets this much more before it is killed
# (for a coroutine that blocks the event loop).
ASYNC_GRACE_S = 1.0

# Rewards become float32 tensors in the loop; a larger finite score would turn into inf there.
FLOAT32_MAX = 3.4028234663852886e38
# exactrl's own files: an exception's place is looked for outside them (the user's reward file).
_PACKAGE_DIR = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep

# A function reference a worker can resolve: ("spec", "file.py:fn" or "module:fn", base_dir) or ("pickled", bytes).
FunctionRef = tuple[str, Any, Any]


def as_score(value: Any, error: BaseException | None, fn: Any = None) -> tuple[float, str | None]:
    """(score, None) for a finite real result, else (0.0, what went wrong). A mapping with a "score" key (what a
    verl `compute_score` may return, with extra keys beside it) counts as its score. `fn` (the function called)
    lets an exception's description name the line of the user's file it came from."""
    if error is not None:
        return 0.0, describe_error(error, fn)
    if isinstance(value, Mapping):
        if "score" not in value:
            return (
                0.0,
                f"returned a {type(value).__name__} without a 'score' key (keys: {sorted(map(str, value))[:8]})",
            )
        value = value["score"]
    if isinstance(value, (str, bytes)) or value is None:
        return 0.0, f"returned {type(value).__name__}, not a number"
    try:
        score = float(value) if isinstance(value, numbers.Real) else float(value.__float__())
    except Exception as e:  # noqa: BLE001 - e.g. a multi-element tensor
        return 0.0, f"returned {type(value).__name__}, not a number ({e})"
    if not math.isfinite(score):
        return 0.0, f"returned non-finite {score!r}"
    if abs(score) > FLOAT32_MAX:
        # Finite here, but the step's rewards are float32 tensors: it would become inf there and every metric nan.
        return (
            0.0,
            f"returned {score!r}, beyond float32's range (+-{FLOAT32_MAX:.4g}), where rewards are kept",
        )
    return score, None


def describe_error(error: BaseException, fn: Any = None) -> str:
    """ "Type: message (at file:line in function)", the place being the traceback's last frame in the file that
    defines `fn` (the user's reward file), else its last frame outside exactrl, else its last frame."""
    text = f"{type(error).__name__}: {error}"
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return text
    home = _defining_file(fn)
    pick = next((f for f in reversed(frames) if home is not None and _real(f.filename) == home), None)
    if pick is None:
        pick = next(
            (f for f in reversed(frames) if not _real(f.filename).startswith(_PACKAGE_DIR)), frames[-1]
        )
    return f"{text} (at {pick.filename}:{pick.lineno} in {pick.name})"


def _real(path: str) -> str:
    return os.path.realpath(path)


def _defining_file(fn: Any) -> str | None:
    """The source file of a function, of a wrapped function (a verl adapter), or of a callable object's class."""
    if fn is None:
        return None
    target = inspect.unwrap(fn) if callable(fn) else fn
    for obj in (target, type(target)):
        try:
            return _real(inspect.getfile(obj))
        except (TypeError, OSError):
            continue
    return None


def as_scores(values: Any, n: int) -> list[tuple[float, str | None]]:
    """A batched function's return value as n (score, problem) pairs; a wrong shape fails all n."""
    try:
        values = list(values)
    except Exception as e:  # noqa: BLE001
        return [(0.0, f"batched function returned {type(values).__name__}, not a list ({e})")] * n
    if len(values) != n:
        return [(0.0, f"batched function returned {len(values)} scores for {n} samples")] * n
    return [as_score(v, None) for v in values]


def is_async(fn: Any) -> bool:
    # An object whose __call__ is `async def` is an async function too.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def flags_of(fn: Any) -> tuple[bool, bool]:
    """(batched, async): a function opts in to batches with an attribute `batched = True`."""
    return getattr(fn, "batched", False) is True, is_async(fn)


# ---------------------------------------------------------------------------------------------------------------
# The worker side


def _resolve(ref: FunctionRef) -> Any:
    kind, what, base_dir = ref
    if kind == "pickled":
        return verl_score.adapt(pickle.loads(what))  # bytes our own parent process produced, never a file
    from exactrl.tasks.reward_fns import resolve_reward

    return resolve_reward(what, base_dir=base_dir)


def _call(fn: Any, args: tuple[Any, ...]) -> tuple[Any, BaseException | None]:
    try:
        value = fn(*args)
        if inspect.isawaitable(value):  # a sync function that returned a coroutine
            value = asyncio.run(_awaited(value))
        return value, None
    except BaseException as e:  # noqa: BLE001 - a plug-in's SystemExit must not end the worker either
        return None, e


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


async def _gather(
    fn: Any, samples: list[tuple[Any, ...]], timeout_s: float
) -> list[tuple[float, str | None]]:
    async def one(args: tuple[Any, ...]) -> tuple[float, str | None]:
        try:
            value = await asyncio.wait_for(fn(*args), timeout_s)
        except asyncio.TimeoutError:
            return 0.0, "timeout"
        except BaseException as e:  # noqa: BLE001
            return as_score(None, e, fn)
        return as_score(value, None)

    return list(await asyncio.gather(*(one(a) for a in samples)))


def worker_main(conn: Connection, refs: list[FunctionRef], sys_path: list[str], progress: Any) -> None:
    """Entry point of a worker process. `progress[0]` counts finished calls of the current request, `progress[1]`
    is when the current call started (`time.monotonic`, one clock for all processes of the machine)."""
    # Ctrl-C reaches the whole process group; the parent decides when its workers end. (SIGTERM is not ignored:
    # multiprocessing ends daemonic workers with it at interpreter exit and then waits for them.)
    enter_worker(sys_path, ignore=(signal.SIGINT,))
    fns: list[Any] = []
    status: list[Any] = []
    for ref in refs:
        try:
            fn = _resolve(ref)
            fns.append(fn)
            status.append(("ok", flags_of(fn)))
        except BaseException as e:  # noqa: BLE001
            fns.append(None)
            status.append(("error", f"{type(e).__name__}: {e}"))
    try:
        _serve(conn, fns, status, progress)
    except (BrokenPipeError, ConnectionResetError):
        return  # the rank that started this worker is gone (killed): its launcher reports that, not this worker


def _serve(conn: Connection, fns: list[Any], status: list[Any], progress: Any) -> None:
    conn.send(("ready", status))

    def handle(msg: tuple[str, int, Any]) -> tuple[str, list[tuple[float, str | None]]]:
        kind, index, payload = msg
        fn = fns[index]
        if kind == "calls":
            out = []
            for args in payload:
                progress[1] = time.monotonic()
                out.append(as_score(*_call(fn, args), fn))
                progress[0] += 1
            return ("ok", out)
        if kind == "batch":
            value, error = _call(fn, payload)
            n = len(payload[0])
            return ("ok", [as_score(None, error, fn)] * n if error is not None else as_scores(value, n))
        if kind == "gather":
            samples, timeout_s = payload
            try:
                return ("ok", asyncio.run(_gather(fn, samples, timeout_s)))
            except BaseException as e:  # noqa: BLE001
                return ("ok", [as_score(None, e, fn)] * len(samples))
        return ("ok", [(0.0, f"unknown request {kind!r}")])

    serve(conn, handle)


# ---------------------------------------------------------------------------------------------------------------
# The parent side


@dataclass
class Job:
    """One request to a worker; `WorkerPool.run` fills in the outcome, read it with `scores()`."""

    kind: str  # "calls", "batch" or "gather"
    index: int  # which function
    payload: Any
    limit_s: float  # per call for "calls", for the whole request otherwise
    num_samples: int
    result: tuple[str, Any] | None = None  # ("ok", pairs), ("timeout", None) or ("died", why)
    # A "calls" request cut short: (position of the call that hung or died, its outcome, the request for the rest).
    split: tuple[int, tuple[float, str], Job] | None = None

    def scores(self) -> list[tuple[float, str | None]]:
        """One (score, problem) per sample; problem is None, "timeout" or what went wrong."""
        if self.split is not None:
            at, failed, rest = self.split
            others = rest.scores() if rest.num_samples else []
            return others[:at] + [failed] + others[at:]
        result: tuple[str, Any] = self.result if self.result is not None else ("died", "no result")
        status, payload = result
        if status == "ok":
            return [(float(score), problem) for score, problem in payload]
        failed = (0.0, "timeout") if status == "timeout" else (0.0, str(payload))
        return [failed] * self.num_samples


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    progress: Any  # shared [calls finished, current call's start time]
    state: str = "starting"  # starting -> idle <-> busy
    job: Job | None = None
    started: float = field(default_factory=time.monotonic)

    def deadline(self) -> float:
        if self.state == "starting":
            return self.started + START_TIMEOUT_S
        assert self.job is not None
        return self.progress[1] + self.job.limit_s


class WorkerStartError(RuntimeError):
    """A worker process could not start (it died before it was ready)."""


def _context() -> Any:
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


# Worker starts one at a time (`_main_not_rerun` changes the process-wide `__main__`): two overlapping blocks would
# restore it out of order, and a start that needs the re-run must not fall inside another's hidden window.
_START_LOCK = threading.Lock()


@contextlib.contextmanager
def _main_not_rerun(needed: bool):
    """A worker started inside this block does not re-run the parent's main module (module docstring), unless
    `needed`. multiprocessing decides from `__main__.__spec__` / `__file__` when the process starts (its preparation
    data, read in `Process.start`), so they are hidden for that call only. Callers hold `_START_LOCK`."""
    main = sys.modules.get("__main__")
    if needed or main is None:
        yield
        return
    saved: dict[str, Any] = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__dict__["__spec__"] = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class WorkerPool:
    """Up to `size` worker processes that call the functions `refs` names; see the module docstring."""

    def __init__(self, refs: list[FunctionRef], size: int, sys_path: Sequence[str] = ()) -> None:
        if size < 1:
            raise ValueError(f"need at least one worker, got {size}")
        self.refs = list(refs)
        self.size = size
        self.sys_path = list(sys_path)
        self.num_killed = 0
        self._ctx = _context()
        self._workers: list[_Worker] = []
        self._status: list[Any] = []

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        progress = self._ctx.RawArray("d", 2)
        proc = self._ctx.Process(
            target=worker_main,
            args=(child, self.refs, self.sys_path, progress),
            name="exactrl-reward",
            daemon=True,
        )
        with _START_LOCK, _main_not_rerun(needed=any(kind == "pickled" for kind, _, _ in self.refs)):
            proc.start()
        child.close()
        worker = _Worker(proc, parent, progress)
        self._workers.append(worker)
        return worker

    def _drop(self, worker: _Worker) -> None:
        if worker.proc.is_alive():
            worker.proc.kill()
        worker.proc.join(5)
        worker.conn.close()
        self._workers.remove(worker)

    def start_one(self) -> list[Any]:
        """Start a worker if none runs and wait until it is ready; returns its per-function status."""
        worker = self._workers[0] if self._workers else self._start()
        if worker.state == "starting":
            self._await_ready(worker, time.monotonic() + START_TIMEOUT_S)
        return self._status

    def _await_ready(self, worker: _Worker, deadline: float) -> None:
        if not wait([worker.conn], max(deadline - time.monotonic(), 0)):
            self._drop(worker)
            raise WorkerStartError(f"a reward worker did not start within {START_TIMEOUT_S:.0f} s")
        self._receive(worker, deque())

    def _receive(self, worker: _Worker, pending: deque[Job]) -> None:
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.proc.join(5) or worker.proc.exitcode
            job = worker.job
            self._drop(worker)
            if job is None:
                raise WorkerStartError(
                    f"a reward worker process exited while starting (exit code {code})"
                ) from None
            self._fail(
                job,
                worker,
                ("died", f"the worker process exited during the call (exit code {code})"),
                pending,
            )
            return
        if worker.state == "starting":
            self._status = msg[1]
            worker.state = "idle"
            return
        assert worker.job is not None
        worker.job.result = (msg[0], msg[1])
        worker.job, worker.state = None, "idle"

    def _fail(self, job: Job, worker: _Worker, outcome: tuple[str, Any], pending: deque[Job]) -> None:
        if job.kind != "calls":
            job.result = outcome
            return
        # Only the call in progress failed: the others of the chunk go to another worker.
        at = min(int(worker.progress[0]), job.num_samples - 1)
        failed = (0.0, "timeout") if outcome[0] == "timeout" else (0.0, str(outcome[1]))
        rest_payload = job.payload[:at] + job.payload[at + 1 :]
        rest = Job("calls", job.index, rest_payload, job.limit_s, len(rest_payload))
        job.split = (at, failed, rest)
        if rest_payload:
            pending.appendleft(rest)

    def run(self, jobs: list[Job]) -> None:
        """Run every job. A call past its `limit_s` has its worker killed (see the module docstring); the pool
        starts a replacement while jobs remain."""
        pending = deque(jobs)
        while pending or any(w.state == "busy" for w in self._workers):
            starting = sum(w.state == "starting" for w in self._workers)
            for worker in [w for w in self._workers if w.state == "idle"]:
                if not pending:
                    break
                job = pending.popleft()
                worker.progress[0], worker.progress[1] = 0, time.monotonic()
                try:
                    worker.conn.send((job.kind, job.index, job.payload))
                except (BrokenPipeError, OSError):  # died while idle; start another
                    pending.appendleft(job)
                    self._drop(worker)
                    continue
                worker.state, worker.job = "busy", job
            # Start workers for the jobs no idle or starting worker will take (a killed one is replaced here).
            for _ in range(min(self.size - len(self._workers), len(pending) - starting)):
                self._start()
            waiting = [w for w in self._workers if w.state in ("starting", "busy")]
            if not waiting:
                continue
            timeout = max(min(w.deadline() for w in waiting) - time.monotonic(), 0)
            ready = wait([w.conn for w in waiting], timeout)
            for worker in [w for w in waiting if w.conn in ready]:
                self._receive(worker, pending)
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.state == "busy" and worker.job is not None and now >= worker.deadline():
                    job = worker.job
                    self.num_killed += 1
                    self._drop(worker)
                    self._fail(job, worker, ("timeout", None), pending)
                elif worker.state == "starting" and now >= worker.deadline():
                    self._drop(worker)
                    raise WorkerStartError(f"a reward worker did not start within {START_TIMEOUT_S:.0f} s")

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        for worker in list(self._workers):
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in list(self._workers):
            worker.proc.join(0.5)
            self._drop(worker)


def close_pool(pool: WorkerPool) -> None:
    """For `weakref.finalize`: stop the workers of a computer that is gone (or at interpreter exit)."""
    pool.close()


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))
