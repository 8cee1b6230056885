"""Partial rollouts under torchrun on CPU ranks (gloo): every rank keeps its own pool of groups in flight (its share
of the prompts), cut by its own count; the guard checks every token a generation samples, carried ones included;
each rank's pool travels in the sharded checkpoint.

One launch at world size 2 (colocated) and one of 3 ranks (1 generator + 2 trainers), the latter with a run stopped
after step 2 (as by a signal) and resumed (make test-all adds the colocated run's stop and resume, a launch of its
own):
- colocated: exact (0 mismatched over every rank's tokens), samples really cut mid-completion and resumed under
  newer weights (mixed-version sequences, 2 versions behind at most), the resumed run bitwise the uninterrupted one
  (make test-all: the disaggregated run's resume shows it by default);
  control: one logprob of a cut sample planted one ulp off is caught by the guard (and that run differs);
- disaggregated: the generator runs each trainer's cut generation; metrics (timings aside) and final weights equal
  the colocated run's at world size 2, its resume included; control: trainers that stop sending
  weights after the first (a stale generator) are caught by the guard and the comparison fails.
The colocated and the disaggregated launches give the same run from two processes apart, so same-seed runs are
identical (one process: tests/train/test_partial.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exactrl.config import AlgorithmConfig
from exactrl.train.checkpoint import PARTIAL_FILE, POOLS_DIR
from exactrl.train.drivers.partial import pools_in
from exactrl.train.partial import merge_partial_metrics
from exactrl.train.preflight import dropped_on_resume

from ._runs import REWARD, launch, mismatched, records, same, small_argv

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("_driver.py")
STEPS = 4
STOP = (
    "[" + ",".join(str(i) for i in range(0, 256, 5)) + "]"
)  # about a fifth of the byte tokens: lengths spread
PARTIAL = [
    "algorithm.max_off_policy_steps=2",
    "algorithm.partial_rollouts=true",
    "algorithm.partial_oversample=1.0",  # per rank: 2 groups trained, 2 more in flight
    "sampling.max_tokens=12",
    "sampling.temperature=0.9",
    f"sampling.stop_token_ids={STOP}",
    "train.save_every=1",
]
DISAGG = "distributed.generator_ranks=1"


def _stopped_and_resumed(tmp: Path, name: str, *extra: str) -> list[dict]:
    """A run stopped after step 2 (as by a signal: its checkpoint holds every rank's pool and pending batch), then
    resumed to the end (two jobs of one launch)."""
    return [
        {"kind": "cli", "argv": small_argv(tmp, name, STEPS, *PARTIAL, *extra), "stop_at": 2},
        {"kind": "cli", "argv": small_argv(tmp, name, STEPS, *PARTIAL, *extra, resume=True)},
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("partial-multirank")
    (tmp / "reward.py").write_text(REWARD)
    planted = small_argv(tmp, "planted", 3, *PARTIAL, "run.on_mismatch=warn")
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "colocated", STEPS, *PARTIAL)},
        {"kind": "cli", "argv": planted, "plant_cut": True},
    ]
    code, out, _ = launch(DRIVER, tmp, 2, jobs, "co", 400)
    assert code == 0, out[-3000:]
    stale = small_argv(tmp, "stale", 3, *PARTIAL, DISAGG, "run.on_mismatch=warn")
    # The disaggregated run is stopped and resumed too: equal to the uninterrupted colocated run, it shows both.
    jobs = [*_stopped_and_resumed(tmp, "disagg", DISAGG), {"kind": "cli", "argv": stale, "skip_push": True}]
    code, out, _ = launch(DRIVER, tmp, 3, jobs, "dis", 400)
    assert code == 0, out[-3000:]
    return tmp


@pytest.fixture(scope="module")
def resumed(runs: Path) -> Path:
    """The colocated run stopped after step 2 and resumed, at world size 2 (a launch of its own: make test-all), in
    the folder of `runs` (the reward's metric names hold its file's path)."""
    code, out, _ = launch(DRIVER, runs, 2, _stopped_and_resumed(runs, "colocated-resumed"), "res", 400)
    assert code == 0, out[-3000:]
    return runs


def _held_pools(ckpt: Path) -> list[dict]:
    """What each of the 2 trainers' pools held at checkpoint `ckpt`."""
    return [json.loads((ckpt / POOLS_DIR / f"rank{r}-of-2" / PARTIAL_FILE).read_text()) for r in (0, 1)]


def _steps(run: Path) -> list[dict]:
    return [r for r in records(run) if "offpolicy/partial/engine_steps" in r]


def test_partial_at_world_size_2_is_exact_and_cuts_mid_completion(runs: Path) -> None:
    rows = _steps(runs / "colocated")
    assert len(rows) == STEPS and mismatched(runs / "colocated") == 0
    assert all(r["mismatch/num_tokens"] > 0 for r in rows if r["offpolicy/partial/engine_steps"] > 0)
    # Cut mid-completion, resumed (recomputed) under newer weights: sequences of two versions, 2 behind at most.
    assert sum(r["offpolicy/partial/recomputed_tokens"] for r in rows) > 0
    assert max(r["offpolicy/mixed_version_seqs"] for r in rows) > 0
    assert max(r["offpolicy/versions_behind/max"] for r in rows) == 2
    assert all(r["optimizer_steps"] == 1 for r in rows)
    ck = runs / "colocated" / "checkpoints" / "step-000002"
    assert pools_in(ck)[0] == 2 and (ck / POOLS_DIR / "rank1-of-2" / PARTIAL_FILE).is_file()


# The disaggregated run below is stopped and resumed by default (its trainers hold the pools as colocated ranks do).
@pytest.mark.extended
def test_partial_resume_at_world_size_2_is_bitwise(runs: Path, resumed: Path) -> None:
    held = _held_pools(resumed / "colocated-resumed" / "checkpoints" / "step-000002")
    assert all(h["pool"] for h in held)  # the resume had groups in flight to take back
    assert same(runs / "colocated", resumed / "colocated-resumed")


def test_a_planted_logprob_in_a_cut_sample_is_caught(runs: Path) -> None:
    """Control: each rank's first cut that leaves a sample mid-completion records its first logprob one ulp off;
    the guard of that generation counts it (on_mismatch = warn lets the run go on), and the run differs."""
    assert mismatched(runs / "planted") == 2
    assert records(runs / "planted") != records(runs / "colocated")[: len(records(runs / "planted"))]


def test_disaggregated_partial_equals_colocated_at_trainer_world_size(runs: Path) -> None:
    """Stopped after step 2 and resumed (its trainers' checkpoint holds their pools), the disaggregated run equals
    the uninterrupted colocated one: steps 1-2 show the layout, steps 3-4 the layout and the resume."""
    assert mismatched(runs / "disagg") == 0
    assert pools_in(runs / "disagg" / "checkpoints" / "step-000002")[0] == 2
    assert all(
        h["pool"] for h in _held_pools(runs / "disagg" / "checkpoints" / "step-000002")
    )  # groups in flight
    assert same(runs / "colocated", runs / "disagg")


def test_a_stale_generator_is_caught_and_differs(runs: Path) -> None:
    assert mismatched(runs / "stale") > 0
    assert records(runs / "stale") != records(runs / "disagg")[: len(records(runs / "stale"))]


def test_pools_per_rank_and_their_counts_merged() -> None:
    a = AlgorithmConfig(rollouts_per_step=20, group_size=4, partial_oversample=0.25)  # 5 prompts a step
    assert a.partial_groups(0, 1) == (5, 2) and a.partial_extra_groups == 2
    assert [a.partial_groups(r, 2) for r in range(2)] == [(3, 1), (2, 1)]
    parts = [
        {"offpolicy/partial/engine_steps": 7.0, "x": 1.0},
        {"offpolicy/partial/engine_steps": 9.0, "x": 2.0},
    ]
    assert merge_partial_metrics(parts) == {"offpolicy/partial/engine_steps": 9.0, "x": 3.0}


def test_a_sharded_checkpoints_pools_are_read_and_said_dropped(tmp_path: Path) -> None:
    """`pools_in` names the world size the pools were saved at and the next request id (a resume at another world
    size starts fresh pools past it); a resume with partial rollouts off says every rank's groups are dropped."""
    assert pools_in(tmp_path) == (None, None)
    for r, n in ((0, 2), (1, 1)):
        d = tmp_path / POOLS_DIR / f"rank{r}-of-2"
        d.mkdir(parents=True)
        groups = [{"request_id": i} for i in range(n)]
        (d / PARTIAL_FILE).write_text(json.dumps({"next_request_id": 12, "pool": groups}))
    assert pools_in(tmp_path) == (2, 12)
    notes = dropped_on_resume(tmp_path, off_policy=True, partial=False)
    assert len(notes) == 1 and "3 prompt group(s) in flight" in notes[0]
    assert dropped_on_resume(tmp_path, off_policy=True, partial=True) == []
    (tmp_path / POOLS_DIR / "rank1-of-2" / PARTIAL_FILE).unlink()
    with pytest.raises(ValueError, match="incomplete"):
        pools_in(tmp_path)
