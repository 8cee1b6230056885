"""Memory phases under torchrun on CPU ranks (gloo): the engine replica released while the trainer trains and
rebuilt by the weight sync's all-gather (exactrl/train/phases.py, `Parallelism.release_replica`).

- world size 2 (default run) and 4 (slow): release on equals release off in every metric and weight bit, no
  mismatched token, and the released bytes are logged; a rebuild that skips the gather (zeros) is the negative
  control;
- resume (slow): a run crashed after step 2 and resumed with the release on continues bit for bit;
- a crash inside a phase switch on one rank (slow) stops every rank with its error, quickly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ._runs import REWARD, SMALL_BF16, launch
from ._runs import mismatched as _mismatched
from ._runs import same as _same
from ._runs import small_argv as _argv

DRIVER = Path(__file__).with_name("_phases_driver.py")
SMALL = SMALL_BF16


def _launch(
    tmp: Path, nproc: int, jobs: list[dict], tag: str, timeout: float = 300
) -> tuple[int, str, float]:
    return launch(DRIVER, tmp, nproc, jobs, tag, timeout)


def _released_gb(run: Path, what: str) -> list[float]:
    key = f"perf/{what}_released_gb"
    return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def _replica_gb() -> float:
    """The engine replica's bytes on every rank: the tiny preset in bf16 (a tied head counted once)."""
    from exactrl.model import build_model, preset

    return sum(p.numel() for p in build_model(preset("tiny"), dtype=torch.bfloat16).parameters()) * 2 / 1e9


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    (tmp_path / "reward.py").write_text(REWARD)
    return tmp_path


def _check_exact(tmp: Path, nproc: int) -> None:
    jobs = [
        {"kind": "cli", "argv": _argv(tmp, "on", 2)},
        {"kind": "cli", "argv": _argv(tmp, "off", 2, "engine.release_memory=false")},
        # Negative control: a rebuild that skips the gather; "warn" keeps the run going past the mismatch.
        {"kind": "cli", "argv": _argv(tmp, "stale", 2, "run.on_mismatch=warn"), "plant": "stale_replica"},
    ]
    code, out, secs = _launch(tmp, nproc, jobs, f"ws{nproc}")
    print(f"world size {nproc}: {secs:.1f} s")
    assert code == 0, out[-6000:]
    assert _same(tmp / "on", tmp / "off")
    assert _mismatched(tmp / "on") == 0
    # Each step's switch freed rank 0's whole replica and its KV cache (the metrics are rank 0's).
    assert _released_gb(tmp / "on", "replica") == [_replica_gb()] * 2
    assert len(_released_gb(tmp / "on", "kv")) == 2 and min(_released_gb(tmp / "on", "kv")) > 0
    assert _released_gb(tmp / "off", "replica") == [] and _released_gb(tmp / "off", "kv") == []
    assert not _same(tmp / "on", tmp / "stale") and _mismatched(tmp / "stale") > 0


@pytest.mark.extended  # the default run keeps the release at world size 2 in the no-update test below (release on
# against off, every record and weight bit) and the stale-replica control in test_multirank
def test_release_is_exact_at_world_size_2(tmp):
    _check_exact(tmp, 2)


def _records_text(run: Path) -> str:
    """The run's step records (timings aside) as text: a skipped step logs NaN (no gradient norm), which equals
    itself only as text."""
    from ._runs import records

    return json.dumps(records(run))


def test_steps_without_an_update_rebuild_the_released_replica(tmp):
    """Step 1 dropped by the guard (run.on_mismatch = "skip_step"), step 2 skipped on the device for a non-finite
    loss, step 3 a normal update: the replica (and the KV cache) released during each step's training phase must be
    back, with the sampling weights' bits, for the next generation, whether or not the step changed a weight. The
    run with the release on equals the run with it off in every record and weight bit."""
    no_update = {"skip": [0], "nan": [1]}
    sets = ("run.on_mismatch=skip_step",)
    jobs = [
        {"kind": "cli", "argv": _argv(tmp, "on", 3, *sets), "no_update": no_update},
        {
            "kind": "cli",
            "argv": _argv(tmp, "off", 3, *sets, "engine.release_memory=false"),
            "no_update": no_update,
        },
    ]
    code, out, secs = _launch(tmp, 2, jobs, "no-update")
    print(f"steps without an update: {secs:.1f} s")
    assert code == 0, out[-6000:]
    rows = [json.loads(line) for line in (tmp / "on" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "optimizer_steps" in r]
    assert [r["optimizer_steps"] for r in steps] == [0.0, 0.0, 1.0]
    assert steps[0]["mismatch/step_skipped"] == 1.0 and steps[1]["nan_skipped"] == 1.0
    # The logprob step 1's plant moved on each rank is the only difference the guard saw: the later steps sampled
    # from the right bits.
    assert [r["mismatch/num_mismatched_tokens"] for r in steps] == [2.0, 0.0, 0.0]
    assert _released_gb(tmp / "on", "replica") == [_replica_gb()] * 3
    assert _records_text(tmp / "on") == _records_text(tmp / "off")
    assert _same_weights(tmp / "on", tmp / "off")


def _same_weights(a: Path, b: Path) -> bool:
    from ._runs import weights

    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.extended  # world size 2 runs by default
def test_release_is_exact_at_world_size_4(tmp):
    _check_exact(tmp, 4)


@pytest.mark.slow
@pytest.mark.extended  # the one-process resume with the release runs by default (tests/train/test_phases.py)
def test_resume_with_the_release_continues_bitwise(tmp):
    import shutil

    ckpt = "train.save_every=1"
    code, out, _ = _launch(tmp, 2, [{"kind": "cli", "argv": _argv(tmp, "whole", 4, ckpt)}], "whole")
    assert code == 0, out[-6000:]
    # A crash right after step 2's checkpoint, then --resume with the release on.
    shutil.copytree(tmp / "whole", tmp / "resumed")
    ckpts = tmp / "resumed" / "checkpoints"
    for d in ckpts.glob("step-*"):
        if int(d.name.split("-")[1]) > 2:
            shutil.rmtree(d)
    (ckpts / "latest").write_text("step-000002\n")
    (tmp / "resumed" / "summary.json").unlink()
    code, out, _ = _launch(
        tmp, 2, [{"kind": "cli", "argv": _argv(tmp, "resumed", 4, ckpt, resume=True)}], "resume"
    )
    assert code == 0, out[-6000:]
    assert _same(tmp / "whole", tmp / "resumed")


@pytest.mark.slow
@pytest.mark.parametrize("plant", [pytest.param("fail_release", marks=pytest.mark.extended), "fail_rebuild"])
def test_a_crash_in_a_phase_switch_on_one_rank_stops_every_rank(tmp, plant):
    job = {"kind": "cli", "argv": _argv(tmp, "crash", 3), "plant": plant, "rank": 1}
    code, out, secs = _launch(tmp, 2, [job], plant, timeout=120)
    print(f"{plant}: exit {code} after {secs:.1f} s")
    assert code != 0
    assert f"planted failure in the replica's {plant.split('_')[1]} on rank 1" in out
    assert secs < 60
    assert not (tmp / "crash" / "summary.json").exists()
