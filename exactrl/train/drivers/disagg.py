"""The trainer side of the weights' way to the engine, disaggregated layout included.

Colocated, the engine samples from the policy itself (one device) or from this rank's replica (torchrun), which the
update's weight sync refreshes. Disaggregated (distributed.generator_ranks > 0, exactrl/train/disagg.py), the engine
is a `RemoteEngine`: the replica is refreshed the same way and trainer 0 then broadcasts its bytes to the
generators; the held-out evaluation is a round every trainer takes part in. Every step driver runs unchanged in
either layout: they call `WeightSync`, which knows which one it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from exactrl.distributed.parallelize import Parallelism
from exactrl.train.disagg import RemoteEngine


class WeightSync:
    """The engine's weights after an update (the replica under torchrun; a no-op on one device) and, disaggregated,
    the generators' (remote: this trainer's handle on its generator, None colocated)."""

    def __init__(self, parallel: Parallelism, remote: RemoteEngine | None) -> None:
        self.parallel = parallel
        self.remote = remote

    @property
    def disaggregated(self) -> bool:
        """Whether the engine runs on generator ranks (the layout's, set once at start)."""
        return self.remote is not None

    def after_update(self) -> dict[str, float]:
        """The replica takes the new weights (rebuilt whole when it was released), then the generators the
        replica's; returns the syncs' metrics."""
        m: dict[str, float] = {}
        m.update(self.parallel.sync_weights())
        m.update(self.to_generators())
        return m

    def to_generators(self, *, full: bool = False) -> dict[str, float]:
        """Disaggregated: the generators take the replica's bytes (every weight with `full`); colocated: nothing."""
        if self.remote is None:
            return {}
        return self.remote.push(self.parallel.replica_weights(full=full))

    def attach_lora(self) -> None:
        """Disaggregated LoRA, once the policy has its adapters: the generators attach the same ones, then take
        every replica tensor (the adapters' values included)."""
        if self.remote is not None:
            self.remote.attach_lora()
            self.to_generators(full=True)

    def push(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Disaggregated: the generators take these weights (the ones RL starts from); colocated: nothing."""
        if self.remote is not None:
            self.remote.push(named)

    @contextmanager
    def round(self) -> Iterator[None]:
        """A round that not every trainer asks of its generator (the held-out evaluation runs on trainer 0's): a
        trainer that asked nothing sends "skip", so every generator's rounds stay in step."""
        if self.remote is not None:
            self.remote.begin_round()
        yield
        if self.remote is not None:
            self.remote.end_round()

    def stop(self) -> None:
        """Disaggregated: the generators' loops end (they would wait for the next round)."""
        if self.remote is not None:
            self.remote.stop()
            self.remote = None
