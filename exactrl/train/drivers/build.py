"""The step driver of a resolved run, made: `ResolvedRun.driver` (chosen by `exactrl.train.drivers.modes`) to
its class, over the run's `StepContext`. Apart from modes.py, which the memory plan and the preflight import
without the drivers."""

from __future__ import annotations

from exactrl.train.drivers.base import StepContext, StepDriver
from exactrl.train.drivers.modes import DriverName
from exactrl.train.drivers.offpolicy import OneStepOffDriver
from exactrl.train.drivers.partial import PartialDriver
from exactrl.train.drivers.sync import SyncDriver
from exactrl.train.drivers.tail import TailDriver
from exactrl.train.offpolicy import BehaviourPolicy
from exactrl.train.offpolicy_dist import ReplicaBehaviour
from exactrl.train.stages import StepRollouts


def build_driver(
    name: DriverName, ctx: StepContext, behaviour: BehaviourPolicy | ReplicaBehaviour | None = None
) -> StepDriver:
    """The driver `name` over `ctx`; one step off and partial rollouts sample from `behaviour`, the engine's own
    weight copy (`RLRun.build_trainer` takes it)."""
    if name == "tail":
        return TailDriver(ctx)
    if name in ("one_step_off", "partial"):
        assert behaviour is not None
        cls = PartialDriver if name == "partial" else OneStepOffDriver
        return cls(ctx, behaviour, StepRollouts)
    return SyncDriver(ctx)
