"""Synchronous environments in worker processes, so that a call that hangs can be stopped.

A Python thread cannot be stopped: an environment that busy-loops in one keeps running, and keeps taking the GIL
from the engine's thread, long after its episode was given up. A process can be killed. `EnvWorkerPool` keeps up
to `size` worker processes; each builds environment objects from the factory it was given (pickled, so a class
or a functools.partial of one travels by its module and name, imported in the worker with the parent's sys.path)
and holds them across an episode's calls: an environment keeps state from reset to its last step, so an episode
stays on the worker that built its environment (episode affinity). A worker runs one call at a time; the calls of
the episodes it holds wait in its queue, and a call's clock starts when the worker takes it.

A call past its limit has its worker killed (SIGKILL). The hung call ends with `EnvCallTimeout`, and so does every
other episode that worker held (their environments died with it): they end with reward 0, counted as timeouts,
and the pool starts a fresh worker for the next episodes. More workers lose fewer episodes per hang, at the cost
of a process each (the worker imports the environment's module, not torch, unless the environment does).

A worker is a fresh interpreter (`python -c`, the same executable), started with one end of a socket pair: never a
`fork` of the trainer, whose process may hold CUDA state a forked child must not touch, and not multiprocessing's
`forkserver` or `spawn` either, whose children re-run the parent's main module (Python 3.11 does not preload it in
the fork server): under `exactrl train` that imports torch and the whole package, seconds per worker, where this
start imports the environment's module alone (about 0.1 s). On Linux a worker dies with the trainer's process
(PR_SET_PDEATHSIG), so a crash of the trainer leaves no spinning environment behind. A worker that cannot build
its factory (e.g. the module is not importable from the worker, or the class lives in the script that was run,
`__main__`) says so once it starts, and the pool raises `EnvWorkerStartError`: a configuration mistake is said,
not turned into a run of zero rewards.

Messages, parent -> worker: ("start", key, (example, turn)) builds the episode's environment, resets it and runs
its first step; ("step", key, turn); ("drop", key) forgets the episode's environment (no answer); None stops.
Worker -> parent: ("ready", None or the error) once, then (key, ("ok", StepResult) or ("error", description)) per
call. The parent drives everything from `pump`, called between engine steps: no thread of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from exactrl.envs.base import EnvFactory, check_step_result, describe_error, source_file
from exactrl.tasks.worker_loop import NO_REPLY, enter_worker, serve

# How long a worker may take to start and import the environment's module (it may import heavy packages).
START_TIMEOUT_S = 120.0


class EnvCallTimeout(TimeoutError):
    """The call ran past its limit (its worker was stopped), or the episode's environment was lost with a worker
    stopped for another episode's hung call."""


class EnvCallError(RuntimeError):
    """The environment raised in its worker, returned something unusable, or its worker died; the message says
    what, and where in the environment's file."""


class EnvWorkerStartError(RuntimeError):
    """A worker process could not start or could not build the environment."""


# ---------------------------------------------------------------------------------------------------------------
# The worker side


def _run(loop: asyncio.AbstractEventLoop, value: Any) -> Any:
    # A factory may build an AsyncEnvironment: its coroutines run on the worker's one event loop (one loop for
    # the worker's life, so an environment may keep loop-bound resources across its calls).
    return loop.run_until_complete(value) if inspect.isawaitable(value) else value


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            # PR_SET_PDEATHSIG: killed when the parent's thread that started this process ends (the trainer's
            # main thread, which runs the episodes), so a crashed trainer leaves no spinning environment.
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)


def worker_main(fd: int, parent_pid: int) -> None:
    """Entry point of a worker process (run by `python -c`, see `_start`): build environments with the factory
    the parent sends first, answer calls until told to stop."""
    _die_with_parent(parent_pid)
    # Ctrl-C, and a scheduler's SIGTERM (Slurm signals every process of the job step), reach the workers too; the
    # trainer finishes its step with them, checkpoints, then stops them. A killed trainer takes them along
    # (PR_SET_PDEATHSIG above).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    factory, sys_path = conn.recv()
    enter_worker(sys_path, ignore=())  # the signals above: ignored from the worker's first line
    try:
        make = pickle.loads(factory)  # bytes our own parent produced, never a file
    except BaseException as e:  # noqa: BLE001 - said to the parent, which raises
        conn.send(("ready", describe_error(e)))
        return
    conn.send(("ready", None))
    loop = asyncio.new_event_loop()
    envs: dict[Hashable, Any] = {}
    user_file = source_file(make)

    def handle(msg: tuple[str, Hashable, Any]) -> Any:
        nonlocal user_file
        op, key, payload = msg
        if op == "drop":
            envs.pop(key, None)
            return NO_REPLY
        try:
            if op == "start":
                example, turn = payload
                try:
                    env = envs[key] = make()
                except BaseException as e:  # noqa: BLE001
                    raise EnvCallError(f"making the environment: {describe_error(e, user_file)}") from None
                user_file = source_file(env) or user_file
                _run(loop, env.reset(example))
            else:
                env, turn = envs[key], payload
            res = _run(loop, env.step(turn))
            problem = check_step_result(res)
            reply: tuple[str, Any] = ("error", problem) if problem is not None else ("ok", res)
        except EnvCallError as e:
            reply = ("error", str(e))
        except BaseException as e:  # noqa: BLE001 - a plug-in's SystemExit must not end the worker either
            reply = ("error", describe_error(e, user_file))
        return (key, reply)

    def unsendable(msg: tuple[str, Hashable, Any], e: Exception) -> Any:
        # e.g. an observation that does not pickle
        return (msg[1], ("error", f"the result could not be sent back from the worker: {describe_error(e)}"))

    serve(conn, handle, unsendable)


# ---------------------------------------------------------------------------------------------------------------
# The parent side


def _exit_code(proc: subprocess.Popen, wait_s: float = 5.0) -> int | None:
    """The process's exit code once it has ended (waited for up to wait_s: a killed process is reaped), else None."""
    try:
        return proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        return None


@dataclass
class _Call:
    key: Hashable
    msg: tuple[str, Hashable, Any]
    limit_s: float
    future: cf.Future


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    state: str = "starting"  # starting -> idle <-> busy
    started: float = field(default_factory=time.monotonic)
    queue: deque[_Call] = field(default_factory=deque)
    current: _Call | None = None
    deadline: float = math.inf  # of the current call, or of the start
    episodes: set[Hashable] = field(default_factory=set)


# The worker's first line: exactrl importable from where this process found it, then the worker's loop.
_BOOT = (
    "import sys; sys.path.insert(0, {root!r}); "
    "from exactrl.envs.workers import worker_main; worker_main({fd}, {pid})"
)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class EnvWorkerPool:
    """Up to `size` worker processes that build environments with `factory` and run their calls; an episode
    (any hashable key) stays on one worker. See the module docstring."""

    def __init__(self, factory: EnvFactory, size: int, sys_path: Sequence[str] | None = None) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"env.workers must be an int >= 1, got {size!r}")
        try:
            self._factory = pickle.dumps(factory)
        except Exception as e:  # noqa: BLE001 - pickling fails with several exception types
            raise ValueError(
                f"the environment factory {factory!r} cannot be sent to a worker process ({type(e).__name__}: "
                f"{e}); give a class defined at the top level of a module (or a functools.partial of one), or "
                "set env.isolation = 'thread' to run it in the trainer's process (a hung call then cannot be "
                "stopped)"
            ) from None
        self.size = size
        self.sys_path = list(sys.path if sys_path is None else sys_path)
        self.num_killed = 0
        self._workers: list[_Worker] = []
        self._home: dict[Hashable, _Worker] = {}  # episode -> the worker that holds its environment
        self._lost: dict[Hashable, str] = {}  # episodes whose environment died with a stopped worker

    # -- episodes and calls ------------------------------------------------------------------------------------
    def call(
        self, key: Hashable, turn: Any, limit_s: float, example: Any = None, first: bool = False
    ) -> cf.Future:
        """Queue the episode's next call: with first=True its environment is built, reset with `example` and
        stepped with `turn` (one call, one limit); else its environment is stepped. The future resolves to a
        checked StepResult, or fails with EnvCallTimeout or EnvCallError."""
        fut: cf.Future = cf.Future()
        if key in self._lost:
            fut.set_exception(EnvCallTimeout(self._lost.pop(key)))
            return fut
        if first:
            worker = self._assign(key)
            msg: tuple[str, Hashable, Any] = ("start", key, (example, turn))
        else:
            home = self._home.get(key)
            if home is None:
                raise KeyError(
                    f"episode {key!r} has no environment in a worker (its first call was not made)"
                )
            worker = home
            msg = ("step", key, turn)
        worker.queue.append(_Call(key, msg, float(limit_s), fut))
        self._dispatch(worker)
        return fut

    def end(self, key: Hashable) -> None:
        """The episode is over: its worker forgets its environment."""
        self._lost.pop(key, None)
        worker = self._home.pop(key, None)
        if worker is None:
            return
        worker.episodes.discard(key)
        try:
            worker.conn.send(("drop", key, None))
        except OSError:  # the worker is gone; so is the environment
            pass

    def _assign(self, key: Hashable) -> _Worker:
        # A new worker while there is room (more workers: fewer episodes lost per hang), else the least loaded.
        if len(self._workers) < self.size:
            worker = self._start()
        else:
            worker = min(self._workers, key=lambda w: len(w.episodes))
        worker.episodes.add(key)
        self._home[key] = worker
        return worker

    # -- driving -------------------------------------------------------------------------------------------------
    def pump(self, timeout: float = 0.0) -> None:
        """Send waiting calls, collect the answers that arrive within `timeout` seconds (sooner if a call's
        deadline comes first), stop workers whose call is past its limit."""
        for w in self._workers:
            self._dispatch(w)
        waiting = [w for w in self._workers if w.state in ("starting", "busy")]
        if not waiting:
            return
        now = time.monotonic()
        t = max(0.0, min(timeout, min(w.deadline for w in waiting) - now))
        for conn in wait([w.conn for w in waiting], t):
            worker = next(w for w in waiting if w.conn is conn)
            self._receive(worker)
        now = time.monotonic()
        for w in list(self._workers):
            if w.state == "busy" and now >= w.deadline:
                self._stop_hung(w)
            elif w.state == "starting" and now >= w.deadline:
                self._drop(w)
                raise EnvWorkerStartError(
                    f"an environment worker did not start within {START_TIMEOUT_S:.0f} s"
                )
        for w in self._workers:
            self._dispatch(w)

    def wait(self, futures: Sequence[cf.Future], timeout: float) -> None:
        """Pump until one of `futures` is done or `timeout` seconds pass (math.inf: until one is done)."""
        end = time.monotonic() + timeout
        while not any(f.done() for f in futures):
            left = end - time.monotonic()
            if left <= 0:
                return
            if not any(w.state in ("starting", "busy") for w in self._workers):
                raise RuntimeError("waiting on environment calls that no worker holds")  # a bookkeeping bug
            self.pump(left)

    def _start(self) -> _Worker:
        parent, child = socket.socketpair()
        fd = child.fileno()
        boot = _BOOT.format(root=_ROOT, fd=fd, pid=os.getpid())
        proc = subprocess.Popen([sys.executable, "-c", boot], pass_fds=[fd], stdin=subprocess.DEVNULL)
        child.close()
        conn = Connection(parent.detach())
        conn.send((self._factory, self.sys_path))  # small; the worker reads it first
        worker = _Worker(proc, conn)
        worker.deadline = worker.started + START_TIMEOUT_S
        self._workers.append(worker)
        return worker

    def _dispatch(self, worker: _Worker) -> None:
        if worker.state != "idle" or not worker.queue:
            return
        call = worker.queue.popleft()
        try:
            worker.conn.send(call.msg)
        except OSError:
            worker.queue.appendleft(call)
            self._worker_died(worker, "the worker process was gone before the call")
            return
        worker.state, worker.current = "busy", call
        worker.deadline = time.monotonic() + call.limit_s  # the clock starts when the worker takes the call

    def _receive(self, worker: _Worker) -> None:
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            code = _exit_code(worker.proc)
            if worker.state == "starting":
                self._drop(worker)
                raise EnvWorkerStartError(
                    f"an environment worker process exited while starting (exit code {code})"
                ) from None
            self._worker_died(worker, f"the worker process exited (exit code {code})")
            return
        if worker.state == "starting":
            _, problem = msg
            if problem is not None:
                self._drop(worker)
                raise EnvWorkerStartError(
                    f"an environment worker process could not build the environment: {problem}; the worker "
                    "imports the environment's module by name with the trainer's sys.path (set env.isolation = "
                    "'thread' to run it in the trainer's process instead)"
                )
            worker.state, worker.deadline = "idle", math.inf
            return
        key, (status, value) = msg
        call = worker.current
        assert call is not None and call.key == key, (call, key)
        worker.state, worker.current, worker.deadline = "idle", None, math.inf
        if status == "ok":
            call.future.set_result(value)
        else:
            call.future.set_exception(EnvCallError(value))

    def _stop_hung(self, worker: _Worker) -> None:
        call = worker.current
        assert call is not None
        self.num_killed += 1
        self._drop(worker)
        call.future.set_exception(
            EnvCallTimeout(
                f"environment call took more than {call.limit_s:g} s; its worker process was stopped"
            )
        )
        self._lose(
            worker,
            call.key,
            EnvCallTimeout,
            f"the environment was lost with its worker process, stopped when episode {call.key} hung",
        )

    def _worker_died(self, worker: _Worker, why: str) -> None:
        call = worker.current
        self._drop(worker)
        if call is not None:
            call.future.set_exception(EnvCallError(f"{why} during the call"))
        self._lose(
            worker, None if call is None else call.key, EnvCallError, f"the environment was lost: {why}"
        )

    def _lose(self, worker: _Worker, culprit: Hashable | None, exc: type[Exception], why: str) -> None:
        """The other episodes of a worker that is gone: queued calls fail now, later calls at once."""
        for call in worker.queue:
            call.future.set_exception(exc(why))
        worker.queue.clear()
        for key in worker.episodes:
            self._home.pop(key, None)
            if key != culprit:  # the culprit's own call has failed already
                self._lost[key] = why
        worker.episodes.clear()

    def _drop(self, worker: _Worker) -> None:
        if worker.proc.poll() is None:
            worker.proc.kill()
        _exit_code(worker.proc)
        worker.conn.close()
        if worker in self._workers:
            self._workers.remove(worker)

    # -- the end -------------------------------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def num_episodes(self) -> int:
        """Episodes whose environment a worker holds (or held, for those lost with a stopped worker)."""
        return len(self._home) + len(self._lost)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop every worker: asked first, killed if it does not end (a hung call never answers). The pool
        may be used again: it starts new workers as calls come."""
        for w in self._workers:
            try:
                if w.state != "busy":
                    w.conn.send(None)
            except OSError:
                pass
        for w in list(self._workers):
            if w.state != "busy":
                _exit_code(w.proc, 0.5)
            self._drop(w)
        self._home.clear()
        self._lost.clear()
