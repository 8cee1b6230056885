"""The loop of a worker process that runs user code for the trainer: reward functions (exactrl.tasks.reward_pool)
and environments (exactrl.envs.workers).

Both kinds of worker do the same around their own calls: leave Ctrl-C to the parent (it decides when its workers
end), find the user's modules on the parent's sys.path, then answer the parent's messages one at a time until it
sends None or goes away. What a message means, and the answer, is the caller's `handle`."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

# What `handle` returns for a message that takes no answer.
NO_REPLY = object()


def enter_worker(sys_path: Sequence[str], ignore: Sequence[signal.Signals] = (signal.SIGINT,)) -> None:
    """A worker's first lines: the signals the parent handles for it ignored, the parent's sys.path in front."""
    for sig in ignore:
        signal.signal(sig, signal.SIG_IGN)
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)


def serve(
    conn: Connection,
    handle: Callable[[Any], Any],
    unsendable: Callable[[Any, Exception], Any] | None = None,
) -> None:
    """Answer the parent's messages until it sends None or its end of `conn` closes: `handle(msg)` returns the
    answer, sent back unless it is NO_REPLY. An answer that cannot be sent (e.g. it does not pickle) is replaced by
    `unsendable(msg, error)` when given."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        reply = handle(msg)
        if reply is NO_REPLY:
            continue
        try:
            conn.send(reply)
        except Exception as e:
            if unsendable is None:
                raise
            conn.send(unsendable(msg, e))
