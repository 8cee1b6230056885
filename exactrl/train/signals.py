"""A run's stop flag: a signal asks the run to stop at its next safe point (after a step, with a checkpoint)."""

from __future__ import annotations

import signal
from typing import Any

from exactrl.distributed.env import under_torchrun
from exactrl.distributed.heartbeat import under_exactrl_launcher


class StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM sets the flag: the current step finishes, a checkpoint is written, the run exits
    cleanly. SIGTERM is what a cluster scheduler (Slurm, Kubernetes) and torchrun's agent send before they kill a
    job: treated like Ctrl-C, a preempted run keeps its work. A second signal gives up waiting."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.stop = False
        self.signal_name: str | None = None  # the signal that asked to stop ("SIGINT", "SIGTERM")
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        # Under torchrun a rank often gets one stop twice: from the scheduler or the terminal (which signal every
        # process of the job) and again from torchrun's agent, which passes every signal on to its ranks. A repeat
        # must not abort the checkpoint then; the agent's SIGKILL after its shutdown timeout is the hard stop.
        repeats_abort = not under_torchrun()

        def handler(signum, frame):
            if self.stop:  # a second signal: give up waiting (one process), or the same stop again (torchrun)
                if repeats_abort:
                    raise KeyboardInterrupt
                return
            self.stop = True
            self.signum = signum
            self.signal_name = signal.Signals(signum).name
            what = "Ctrl-C" if signum == signal.SIGINT else self.signal_name
            # Under a plain torchrun a second one changes nothing; exactrl's launcher kills the ranks on it.
            again = f"{what} again to abort"
            if not (repeats_abort or under_exactrl_launcher()):
                again = "torchrun's agent kills the ranks after its shutdown timeout"
            print(f"\n{what}: finishing this step, then writing a checkpoint ({again})", flush=True)

        for sig in self.SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: signals are not ours to take
                break
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
