"""Progress of the phases that can run for minutes before anything else prints: building a model's random weights,
loading a checkpoint, capturing CUDA graphs, a first compile.

On a terminal a tqdm bar on stderr; off a terminal (a log file, a scheduler's output) plain lines, since a bar's
carriage-return redraws pile up into one enormous line there. Either way a phase that ends within `SHOW_AFTER_S`
says nothing (a tiny model builds in milliseconds, and tests and quick commands stay quiet); one that runs longer
shows its bar, or a line after `SHOW_AFTER_S`, one every `EVERY_S` while it goes on (from a heartbeat thread, so a
single long call, such as one graph capture, still shows the process alive) and one at its end with the time
it took. Under torchrun only rank 0 speaks (every rank runs the same phases).

Imports nothing from exactrl: the model, the engine and the trainer all use it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType
from typing import IO, Any

SHOW_AFTER_S = 2.0  # a phase shorter than this prints nothing
EVERY_S = 30.0  # off a terminal: a line this often while the phase runs


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


def amount(n: float, unit: str) -> str:
    """1.2B params, 596M params, 3.4 GB, 12 graphs: how a count reads in a log line."""
    if unit == "B":  # bytes
        for size, suffix in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if n >= size:
                return f"{n / size:.1f} {suffix}"
        return f"{int(n)} B"
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.1f}{suffix} {unit}".rstrip()
    return f"{int(n)} {unit}".rstrip()


class Progress:
    """One phase's progress: `update(n)` as work is done, `close()` (or the `with` block's end) when it is over.

    desc: what the phase does ("building qwen3-30b-a3b (bfloat16, cuda)"); total: the work in `unit`s (None:
    unknown, then the lines give the time alone); stream: stderr unless given; enabled: False shows nothing."""

    def __init__(
        self,
        desc: str,
        total: float | None = None,
        unit: str = "",
        *,
        stream: IO[str] | None = None,
        enabled: bool = True,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.done = 0.0
        self.stream = sys.stderr if stream is None else stream
        self.t0 = time.perf_counter()
        self._bar: Any = None
        self._lines = 0  # log lines printed so far (an end line only follows a first one)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        if not enabled or os.environ.get("RANK", "0") != "0":
            self._closed = True
            return
        if _is_tty(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=unit or "it",
                unit_scale=True,
                leave=False,
                file=self.stream,
                delay=SHOW_AFTER_S,
            )
        else:
            self._thread = threading.Thread(target=self._heartbeat, name="exactrl-progress", daemon=True)
            self._thread.start()

    def _state(self) -> str:
        secs = time.perf_counter() - self.t0
        if self.total:
            share = min(self.done / self.total, 1.0)
            done = amount(self.done, "B" if self.unit == "B" else "")
            return f"{share:.0%} ({done} of {amount(self.total, self.unit)}), {secs:.0f} s"
        return f"{amount(self.done, self.unit)}, {secs:.0f} s" if self.unit else f"{secs:.0f} s"

    def _say(self, text: str) -> None:
        print(f"{self.desc}: {text}", file=self.stream, flush=True)
        self._lines += 1

    def _heartbeat(self) -> None:
        wait = SHOW_AFTER_S
        while not self._stop.wait(wait):
            self._say(self._state())
            wait = EVERY_S

    def update(self, n: float = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def close(self, error: BaseException | None = None) -> None:
        """The phase is over (error: what ended it early): the bar goes; off a terminal a line with the time, if
        the phase has printed one."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            return
        assert self._thread is not None
        self._stop.set()
        self._thread.join()
        if self._lines:
            secs = time.perf_counter() - self.t0
            if error is not None:
                self._say(f"stopped by {type(error).__name__} at {self._state()}")
            else:
                what = f"{amount(self.done, self.unit)} " if self.unit else ""
                self._say(f"done, {what}in {secs:.1f} s")

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(err)
