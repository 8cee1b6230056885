"""The disaggregated layout on CPU ranks (gloo): generator ranks apart from trainer ranks change where samples are
generated, never the bits. A run of 3 ranks with distributed.generator_ranks = 1 (2 trainers) equals the colocated
run of 2 ranks step for step (every metric but timings) and in its final weights; a run whose trainers stop sending
weights after the first (the generators sample from stale weights) differs and its guard counts mismatches. A
disaggregated run resumed from its sharded checkpoint (the trainers' DCP) equals the uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._runs import REWARD, crashed_after, launch, mismatched, records, same, small_argv

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("_driver.py")
STEPS = 3
# Held-out evaluations before RL, after step 2 and after RL (trainer 0's generator runs them, the other trainer's
# rounds kept in step), and a checkpoint every step.
EVAL = ["task.num_eval=4", "task.eval_every=2", "train.save_every=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("disagg")
    (tmp / "reward.py").write_text(REWARD)
    disagg = ["distributed.generator_ranks=1"]
    code, out, _ = launch(
        DRIVER, tmp, 2, [{"kind": "cli", "argv": small_argv(tmp, "colocated", STEPS, *EVAL)}], "co", 400
    )
    assert code == 0, out[-3000:]
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "disagg", STEPS, *EVAL, *disagg)},
        {
            "kind": "cli",
            "argv": small_argv(tmp, "stale", STEPS, *EVAL, *disagg, "run.on_mismatch=warn"),
            "skip_push": True,
        },
    ]
    code, out, _ = launch(DRIVER, tmp, 3, jobs, "dis", 600)
    assert code == 0, out[-3000:]
    # A crash after step 2's checkpoint (DCP over the two trainers), resumed in the same layout.
    crashed_after(tmp / "disagg", tmp / "resumed", 2)
    argv = small_argv(tmp, "resumed", STEPS, *EVAL, *disagg, resume=True)
    code, out, _ = launch(DRIVER, tmp, 3, [{"kind": "cli", "argv": argv}], "res", 400)
    assert code == 0, out[-3000:]
    return tmp


def test_disaggregated_equals_colocated_at_trainer_world_size(runs: Path) -> None:
    # the steps, and the evaluations before and after RL (the one after step 2 is in its record)
    assert len(records(runs / "colocated")) == STEPS + 2
    assert sum("eval/reward" in r for r in records(runs / "colocated")) == 3
    assert mismatched(runs / "disagg") == 0
    assert same(runs / "colocated", runs / "disagg")


def test_disaggregated_resume_equals_the_uninterrupted_run(runs: Path) -> None:
    assert same(runs / "disagg", runs / "resumed")


def test_stale_generator_weights_differ_and_the_guard_sees_it(runs: Path) -> None:
    assert mismatched(runs / "stale") > 0
    assert not same(runs / "colocated", runs / "stale")
