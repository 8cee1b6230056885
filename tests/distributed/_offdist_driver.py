"""The multi-rank one-step-off tests' launch target: `_driver.py`'s jobs, plus what these tests plant and record.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/distributed/_offdist_driver.py SPEC.json

SPEC.json: {"jobs": [job, ...]}, run in order on every rank. Besides `_driver.py`'s kinds:
  {"kind": "cli", "argv": [...], ...} with any of
     "record": DIR          every rank writes DIR/rank<r>.json: the run's outcome (the exception's type and message,
                            or none), whether the engine samples from the replica the weight sync refreshes, how many
                            model copies the process holds; and per step, the version and a digest of the weights
                            the replica held as the worker started and as it finished sampling
     "slow_worker": SECONDS the worker sleeps before it samples (it then outlasts the update)
     "save_weights": DIR    rank 0 also saves the replica's weights as each batch's sampling starts (DIR/step<s>.pt)
     "plant_ulp": [R, K]    rank R's K-th generate call (1-based) records its first logprob one ulp off: a fault
                            the guard must catch, on every rank, before the update
     "worker_fail": [R, S]  rank R's sampling of step S's batch (1-based; in the worker from step 2 on) raises
     "refuse_offpolicy": true  the off-policy machinery raises if it runs at all (k = 0 must not touch it)
  {"kind": "crash_copy", "src": DIR, "dst": DIR, "step": S}
                            rank 0 copies run `src` as a crash right after step S's checkpoint leaves it, then
                            every rank waits for it (a barrier)
A job that fails ends the launch (the failing scenarios are each a launch's last job).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

import _driver  # noqa: E402  (the shared multi-rank driver, beside this file)


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Patches:
    """setattr that is undone after the job (the jobs of a launch share the process)."""

    def __init__(self) -> None:
        self.undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self.undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, old in reversed(self.undo):
            setattr(owner, name, old)


def cli_job(job: dict) -> None:
    import exactrl.engine.engine as engine_mod
    from exactrl.model.qwen import CausalLM
    from exactrl.train import loop, offpolicy_dist
    from exactrl.train.drivers import offpolicy as offpolicy_driver
    from exactrl.train.drivers.offpolicy import OneStepOffDriver

    rank = int(os.environ["RANK"])
    record: dict[str, Any] = {"rank": rank, "error": None, "error_type": None, "steps": {}}
    patches = _Patches()
    runs: list[Any] = []

    sample: Callable[..., Any] = OneStepOffDriver.sample

    def spy_sample(self, step, check=True):
        version = self.behaviour.version
        start = _digest(self.behaviour.model)
        if job.get("save_weights") and rank == 0:
            path = Path(job["save_weights"]) / f"step{step + 1}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({k: v.clone() for k, v in self.behaviour.model.state_dict().items()}, path)
        if job.get("slow_worker") and threading.current_thread() is not threading.main_thread():
            # The worker samples longer than the update takes: a refresh that did not wait for it would land
            # while it samples (the tiny model's sampling is otherwise over long before the update is).
            time.sleep(job["slow_worker"])
        fail = job.get("worker_fail")
        if fail is not None and rank == fail[0] and step + 1 == fail[1]:
            raise RuntimeError(f"planted worker failure on rank {rank} sampling step {step + 1}")
        out = sample(self, step, check)
        record["steps"][str(step + 1)] = {
            "version": version,
            "start": start,
            "end": _digest(self.behaviour.model),  # the replica did not change under the worker
        }
        return out

    patches.set(OneStepOffDriver, "sample", spy_sample)

    if job.get("plant_ulp") is not None:
        r, k = job["plant_ulp"]
        calls = {"n": 0}
        collect = engine_mod._Generation.collect

        def planted(self, outputs):
            collect(self, outputs)
            calls["n"] += 1
            if rank == r and calls["n"] == k:
                lp = next(s for o in outputs for s in o.samples).rollout_logprobs
                lp[0] = torch.nextafter(lp[0], torch.tensor(0.0))

        patches.set(engine_mod._Generation, "collect", planted)

    if job.get("refuse_offpolicy"):

        def refuse(*a, **k):
            raise AssertionError("the off-policy machinery ran at max_off_policy_steps = 0")

        for name in ("ReplicaBehaviour", "BehaviourPolicy"):
            patches.set(loop, name, refuse)
        for name in ("GenerationWorker", "agree_guard", "step_staleness"):
            patches.set(offpolicy_driver, name, refuse)
        patches.set(OneStepOffDriver, "__init__", refuse)

    make_driver = loop.RLRun.make_driver

    def spy_make_driver(self):  # the run, before its first step (a refused batch never reaches finish)
        runs[:1] = [self]
        return make_driver(self)

    patches.set(loop.RLRun, "make_driver", spy_make_driver)

    finish = loop.RLRun.finish

    def spy_finish(self):
        runs[:1] = [self]
        return finish(self)

    patches.set(loop.RLRun, "finish", spy_finish)
    try:
        _driver.cli_job(job)
    except BaseException as err:
        record["error_type"] = type(err).__name__
        record["error"] = str(err)
        raise
    finally:
        patches.restore()
        if runs:
            run = runs[0]
            replica_tensors = {id(t) for t in run.engine.model.parameters()}
            record["replica_behaviour"] = isinstance(run.behaviour, offpolicy_dist.ReplicaBehaviour)
            record["engine_is_behaviour"] = (
                run.behaviour is not None and run.engine.model is run.behaviour.model
            )
            # The weight sync writes into the very tensors the engine samples from.
            record["sync_targets_engine"] = bool(run.parallel._pairs) and all(
                id(e) in replica_tensors for _, e in run.parallel._pairs
            )
            gc.collect()  # models alive, not garbage a cycle holds until the collector happens to run
            record["models"] = sum(isinstance(o, CausalLM) for o in gc.get_objects())
            # AdamW steps the policy took on this rank (a refused batch must add none).
            states = [run.opt.opt.state.get(m, {}) for m in run.opt.master]
            record["adam_steps"] = max((float(st["step"]) for st in states if "step" in st), default=0.0)
        if job.get("record"):
            out = Path(job["record"])
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank}.json").write_text(json.dumps(record))


def crash_copy_job(job: dict) -> None:
    from _runs import crashed_after

    from exactrl.distributed.env import init_from_env

    ctx = init_from_env("cpu")
    if ctx.is_main:
        crashed_after(Path(job["src"]), Path(job["dst"]), int(job["step"]))
    ctx.barrier()


def main() -> None:
    import exactrl.cli

    leave = exactrl.cli._end_process_group
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    kinds = {"cli": cli_job, "crash_copy": crash_copy_job, "weights": _driver.weights_job}
    for job in spec["jobs"]:
        kinds[job["kind"]](job)
    leave()


if __name__ == "__main__":
    main()
