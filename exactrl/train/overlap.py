"""Train on a batch's finished groups while its tail still generates (algorithm.overlap = "tail").

A synchronous step waits for its longest completion: the last seconds of generation run a handful of sequences
on an almost idle GPU while the trainer waits. Here the engine generates the step's batch in a worker thread
(`GenerationWorker`, on a high-priority CUDA stream) and reports each prompt as soon as all its samples have
finished (`RolloutEngine.generate(on_request_done=...)`). The loop's thread scores that group (rewards, and its
advantages: GRPO-style advantages are computed within a group) and feeds the finished rollouts to the trainer as
microbatches (`PolicyTrainer.accumulate`: forward + loss + backward into the gradient buffers) while the rest of
the batch keeps generating. The optimizer step waits for the whole batch (`finish_accumulation`).

Why this stays on-policy and exact: nothing writes the weights before the optimizer step (a forward and a
backward only write activations and gradients), so every token of the batch is sampled by the same weights the
trainer's forward uses, and the guard is the usual one: each token's recorded logprob is compared with the
training forward's inside the microbatch that trains on it, and a difference skips the one optimizer step on
the device. The engine's scheduling and sampling are untouched: the rollouts are the synchronous run's, bit for
bit. The update is not bitwise the synchronous one's: its microbatches follow the order groups finished (which is
deterministic: same seed, same run), and the loss enters each backward unnormalised, the summed gradients being
divided by the batch's token (or sequence) count once at the end (`finish_accumulation` says what that does).

Host threads: both threads hold Python's GIL in turn. The engine thread releases it while it waits for each step's
tokens and must get it back quickly, or a decode step waits behind the trainer's Python; the switch interval is
lowered for the step (`GIL_SWITCH_INTERVAL_S`), and restored after.

Microbatch composition follows the finish order alone (`MicrobatchFiller`), never the timing: a microbatch is
closed when the next finished rollout would not fit the token budget, exactly as `pack_by_tokens` cuts a list.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from exactrl.engine.engine import RequestOutput, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.train.offpolicy import GenerationWorker
from exactrl.train.trainer import Rollout

# While a step overlaps, Python hands the GIL over after at most this long (its default is 5 ms): the engine thread,
# back from waiting for a decode step's tokens, gets it within this instead of queuing a whole interval behind the
# trainer's host work (a decode step in the tail is a few milliseconds).
GIL_SWITCH_INTERVAL_S = 5e-4
# The generation stream's CUDA priority: lower is higher. Priority orders the thread blocks waiting for an SM; it
# preempts nothing, and the trainer's persistent GEMMs hold every SM for their whole run, so on the H100 a decode
# step beside training was as slow on a high-priority stream as on a default one (benchmarks/probe_priority.py,
# docs/benchmarks.md "Generation and training on one GPU"). Kept because it costs nothing and helps against non-persistent kernels.
GENERATION_STREAM_PRIORITY = -1


_END = object()  # the worker's last item: generation returned (or failed)


class GroupStream:
    """`generate` in a worker thread; the finished requests handed to the caller's thread one by one."""

    def __init__(self, device: torch.device | str) -> None:
        self.worker = GenerationWorker(device, priority=GENERATION_STREAM_PRIORITY)
        self._queue: queue.Queue[Any] = queue.Queue()
        self._done = threading.Event()
        self.generate_s = 0.0  # the generate call's wall time (in the worker)
        self.wait_s = 0.0  # the caller blocked on the next finished request

    @property
    def generating(self) -> bool:
        return not self._done.is_set()

    def start(
        self,
        engine: RolloutEngine,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        request_ids: list[int],
        progress: Callable[[int], object] | None = None,
    ) -> None:
        self._done.clear()
        self.generate_s = self.wait_s = 0.0

        def job() -> list[RequestOutput]:
            t0 = time.perf_counter()
            try:
                return engine.generate(
                    prompt_ids, params, request_ids, progress=progress, on_request_done=self._queue.put
                )
            finally:
                self.generate_s = time.perf_counter() - t0
                self._done.set()
                self._queue.put(_END)

        self.worker.start(job)

    def __iter__(self) -> Iterator[RequestOutput]:
        """The requests as they finish; then the generate call's own outcome (its exception, if it failed)."""
        while True:
            t0 = time.perf_counter()
            item = self._queue.get()
            self.wait_s += time.perf_counter() - t0
            if item is _END:
                break
            yield item
        self.worker.result()  # joins the thread; raises what generate raised

    def close(self) -> None:
        """Wait for a generation still running (the caller failed under it) and drop what is left."""
        self.worker.close()
        self._queue = queue.Queue()


class MicrobatchFiller:
    """Finished rollouts, in the order they arrive, cut into microbatches of at most `max_tokens` tokens (a longer
    rollout gets one of its own): `pack_by_tokens`'s rule applied online, so the cut depends on the order alone."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._current: list[Rollout] = []
        self._used = 0

    def add(self, rollouts: list[Rollout]) -> list[list[Rollout]]:
        """Take rollouts; return the microbatches they closed."""
        closed = []
        for r in rollouts:
            n = len(r.prompt_ids) + len(r.completion_ids) - 1  # the tokens the training forward runs
            if self._current and self._used + n > self.max_tokens:
                closed.append(self._current)
                self._current, self._used = [], 0
            self._current.append(r)
            self._used += n
        return closed

    def flush(self) -> list[list[Rollout]]:
        """The last, partly filled microbatch (none when empty)."""
        rest, self._current, self._used = self._current, [], 0
        return [rest] if rest else []
