"""Starting torchrun from `exactrl ... --nproc N`, and signals on their way to the ranks.

A scheduler stops a job with SIGTERM (Ctrl-C is SIGINT) and kills it a grace period later. Each rank then
finishes its step and checkpoints (`exactrl.train.loop._StopFlag`); torchrun's agent passes the signal it gets on
to every rank and kills them after its own shutdown timeout (`--shutdown-timeout`, TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
30 s by default: set it above a step plus a checkpoint). The launcher below makes sure the agent gets the signal
the `exactrl` process got, once: the agent runs in a session of its own (a terminal's Ctrl-C, or a signal to the
launcher's process group, reaches the launcher alone), and the launcher forwards the first SIGINT / SIGTERM.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

FORWARDED = (signal.SIGINT, signal.SIGTERM)


def call_forwarding_signals(cmd: list[str]) -> int:
    """Run `cmd` (torchrun) to its end and return its exit status (128 + the signal after a forwarded stop, as
    one process exits after it), handing it the first SIGINT and the first
    SIGTERM this process receives. Without this, a SIGTERM to the launcher alone (Kubernetes signals a pod's
    first process) killed it and left torchrun and its ranks running unaware, and a Ctrl-C made
    `subprocess.call` SIGKILL torchrun's agent before any rank could checkpoint."""
    proc = subprocess.Popen(cmd, start_new_session=True)
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
