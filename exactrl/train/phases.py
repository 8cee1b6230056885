"""Memory phases of the RL loop: what the device holds while the engine generates and while the trainer trains.

Generation needs the engine's weights and its KV cache; the trainer's step needs its own state, the gradients
and one microbatch's activations. With `engine.release_memory` (the default) the switch to training frees the
KV cache and, under torchrun, the engine's full-weight replica; the next `generate` allocates the cache again
and the weight sync after the optimizer step rebuilds the replica (its all-gather runs anyway). So the phases
do not overlap, and the memory plan (exactrl/train/memory.py) counts each term only in the phases that hold it.

Nothing here changes a bit: the cache holds nothing across `generate` calls (each starts with a fresh block
manager), and the replica's every byte is written by the gather before the engine reads it. What can change is
an address: CUDA graphs hold raw pointers, so the engine's decode graphs are kept when the cache comes back at
its old address and captured again when it (or a weight) moved; both are counted here as perf metrics.

Not with `algorithm.max_off_policy_steps >= 1` or `algorithm.overlap = "tail"`: the engine then generates (the
next batch from its own weight copy, or the tail of this one) while the trainer trains, so its memory is needed
in both phases.
"""

from __future__ import annotations

import time
from typing import Any

from exactrl.engine.engine import RolloutEngine
from exactrl.train.drivers.modes import DriverName, driver_of, overlaps


def phases_overlap(cfg: Any) -> bool:
    """Whether the engine generates while the trainer trains (`exactrl.train.drivers.modes.overlaps` of the
    config's driver): its memory is then needed in both phases and nothing is released."""
    return overlaps(driver_of(cfg))


def releases_memory(cfg: Any, driver: DriverName | None = None) -> bool:
    """Whether the run frees the engine's memory during training (the plan and the loop ask the same). driver: the
    run's, resolved once (`exactrl.train.resolved`); None: the one the config selects."""
    return bool(cfg.engine.release_memory) and not overlaps(driver or driver_of(cfg))


class MemoryPhases:
    """The switches between the generation and training phases of one run, and what they cost.

    release: whether the switch to training frees the engine's memory (`ResolvedRun.releases_memory`). kv_blocks:
    the KV cache's size from the memory plan (None: the engine sizes it itself). parallel: the run's `Parallelism`
    (its replica is released under torchrun)."""

    def __init__(self, release: bool, parallel: Any, kv_blocks: int | None) -> None:
        self.release = release
        self.parallel = parallel
        self.kv_blocks = kv_blocks
        self._runner: Any = None  # the engine runner of the last `metrics`, and its counters then
        self._seen: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)
        self._released_s = 0.0
        self._released = (0, 0)  # bytes of the KV cache and of the replica the last switch freed

    def size(self, engine: RolloutEngine) -> None:
        """Give `engine` the plan's KV size unless the config fixed one (engine.num_kv_blocks). Called before
        every generation of the run, so that an engine made later (the replica's, a benchmark's) gets it too."""
        if self.kv_blocks is not None and engine.config.num_kv_blocks is None:
            engine.config.num_kv_blocks = self.kv_blocks

    def to_generation(self, engine: RolloutEngine) -> None:
        """The engine is about to generate (every rank, together: the rebuild is a collective). The plan's KV size
        (`size`); the KV cache itself comes back inside `generate`. The replica normally came back in the weight
        sync that ends every step, whether or not the step made an update; a step that ended without that sync
        (a driver that skips it when nothing changed) would leave the engine sampling from freed storage, so it is
        rebuilt here from the shards: the same bits the sync would have written."""
        self.size(engine)
        if self.parallel.replica_released:
            self.parallel.sync_weights()

    def to_training(self, engine: RolloutEngine) -> None:
        """Generation is over for this step: free the KV cache, and the replica under torchrun. No-op when the
        run keeps them (engine.release_memory = false, one step off)."""
        if not self.release:
            return
        t0 = time.perf_counter()
        replica = self.parallel.release_replica()
        kv = engine.release_kv()  # last: it gives the cached blocks (the replica's too) back to the device
        self._released = (kv, replica)
        self._released_s = time.perf_counter() - t0

    def metrics(self, engine: RolloutEngine) -> dict[str, float]:
        """The step's phase-switch costs: the KV allocation before its generation (after the first), the decode
        graphs dropped because the cache or a weight moved and the time spent capturing them again, and what the
        switch to training freed."""
        r = engine.runner
        if r is None:
            return {}
        now = (r.kv_allocations, r.kv_allocate_s, r.graphs_dropped, r.capture_seconds)
        prev = self._seen if r is self._runner else (0, 0, 0, 0.0)  # a new runner counts from 0
        self._runner, self._seen = r, now
        out = {
            "perf/kv_allocate_s": now[1] - prev[1],
            "perf/decode_graphs_recaptured": float(now[2] - prev[2]),
            "perf/decode_graph_capture_s": now[3] - prev[3],
        }
        if self.release:
            out["perf/release_s"] = self._released_s
            out["perf/kv_released_gb"] = self._released[0] / 1e9
            if self.parallel.sharded:
                out["perf/replica_released_gb"] = self._released[1] / 1e9
        return out
