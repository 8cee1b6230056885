"""The memory-phase jobs of tests/distributed/test_phases_multirank.py, under `python -m torch.distributed.run`:
`_driver.py`'s cli jobs, with an optional planted bug in a phase switch for the job's duration.

    {"kind": "cli", "argv": [...], "plant": NAME, "rank": R}   NAME on rank R only (every rank when R is absent):
      "fail_release"   the switch to training raises (the replica's release)
      "fail_rebuild"   the replica's rebuild in the weight sync raises
      "stale_replica"  the rebuild skips the all-gather and leaves zeros: the negative control
    {"kind": "cli", "argv": [...], "no_update": {"skip": [S, ...], "nan": [S, ...]}}   steps that make no update
      (step indices from 0, on every rank): "skip" moves one rollout logprob of the step by one ulp (the guard's
      mismatch: run.on_mismatch = "skip_step" drops the step), "nan" gives one rollout a NaN advantage (a
      non-finite loss: the device skips the optimizer step)
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _driver  # noqa: E402


def _plant(name: str, rank: int):
    """Patch the phase switch; returns the function that undoes it."""
    from exactrl.distributed.parallelize import Parallelism

    real_release, real_sync = Parallelism.release_replica, Parallelism.sync_weights

    def fail_release(self):
        raise RuntimeError(f"planted failure in the replica's release on rank {rank}")

    def fail_rebuild(self, full=False):
        if self.replica_released:
            raise RuntimeError(f"planted failure in the replica's rebuild on rank {rank}")
        return real_sync(self, full)

    def stale_replica(self, full=False):
        if not self.replica_released:
            return real_sync(self, full)
        self._restore_replica()
        for _, e in self._pairs:
            e.zero_()
        return {}

    if name == "fail_release":
        Parallelism.release_replica = fail_release
    else:
        Parallelism.sync_weights = {"fail_rebuild": fail_rebuild, "stale_replica": stale_replica}[name]

    def undo():
        Parallelism.release_replica, Parallelism.sync_weights = real_release, real_sync

    return undo


def _no_update(skip: list[int], nan: list[int]):
    """Patch the loop's update so that the listed steps make none; returns the function that undoes it."""
    from exactrl.train import stages

    real = stages.RunStages.update

    def update(self, step, rollouts, *a, **k):
        if step in skip:
            r = rollouts[0]
            lp = r.rollout_logprobs.clone()
            lp[0] = torch.nextafter(lp[0], torch.tensor(-math.inf))
            r.rollout_logprobs = lp
        if step in nan:
            rollouts[0].advantage = math.nan
        return real(self, step, rollouts, *a, **k)

    stages.RunStages.update = update

    def undo():
        stages.RunStages.update = real

    return undo


def main() -> None:
    import exactrl.cli

    leave = exactrl.cli._end_process_group
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    for job in spec["jobs"]:
        plant = job.get("plant")
        undo = None
        if plant is not None and job.get("rank", rank) == rank:
            undo = _plant(plant, rank)
        if "no_update" in job:
            assert undo is None, "one patch a job"
            undo = _no_update(job["no_update"].get("skip", []), job["no_update"].get("nan", []))
        try:
            _driver.cli_job(job)
        finally:
            if undo is not None:
                undo()
    leave()


if __name__ == "__main__":
    main()
