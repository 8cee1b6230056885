"""Generator ranks that share one engine split over them (distributed.generator_ranks = 2 with
engine.tensor_parallel = 2, exactrl/distributed/layout.py): the trainer sends each command to both generator ranks,
both run the same engine calls (every forward's all-gathers among them), the first answers, and each takes its slice
of every weight trainer 0 broadcasts whole. On 3 CPU ranks (1 trainer, one engine of 2 generators) a run equals the
colocated run of one FSDP2 rank step for step (every metric but timings, the held-out evaluations included) and in
its final weights, bit for bit: full weights, and (make test-all) LoRA (the adapters attached on the generators after
their split, each sync moving the adapters alone, B sliced), one step off, partial rollouts and multi-turn episodes
(the first generator rank calls the environment, the other follows its verdicts in lockstep). In fp8 too, each
generator rank holding its projections as its rows of their fp8 copies alone (no model-dtype weights), the first
sync's model-dtype weights quantized whole and cut on arrival. The control plants Megatron's row-parallel arithmetic
in the generators' o_proj / down_proj: the guard counts mismatched tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._runs import REWARD, launch, mismatched, records, same, small_argv
from .test_disagg import FP8, MULTI_TURN
from .test_partial_multirank import PARTIAL

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("_driver.py")
STEPS = 3
EVAL = ["task.num_eval=4", "task.eval_every=2"]
SPLIT = ["distributed.generator_ranks=2", "engine.tensor_parallel=2"]
LORA = ("lora.rank=4", "algorithm.kl_coef=0.05")
K1 = "algorithm.max_off_policy_steps=1"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("disagg-split")
    (tmp / "reward.py").write_text(REWARD)
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "colocated", STEPS, *EVAL)},
        {"kind": "cli", "argv": small_argv(tmp, "colocated-fp8", STEPS, *EVAL, FP8)},
    ]
    code, out, _ = launch(DRIVER, tmp, 1, jobs, "co", 400)
    assert code == 0, out[-3000:]
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "split", STEPS, *EVAL, *SPLIT)},
        {
            "kind": "cli",
            "argv": small_argv(tmp, "split-fp8", STEPS, *EVAL, *SPLIT, FP8),
            "generator_memory": str(tmp / "memory-fp8.json"),
        },
        {
            "kind": "cli",
            "argv": small_argv(tmp, "planted", 1, *SPLIT, "run.on_mismatch=warn"),
            "plant": "row_parallel",
        },
    ]
    code, out, _ = launch(DRIVER, tmp, 3, jobs, "split", 600)
    assert code == 0, out[-3000:]
    return tmp


@pytest.fixture(scope="module")
def more_runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("disagg-split-more")
    (tmp / "reward.py").write_text(REWARD)
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "colocated-lora", STEPS, *LORA)},
        {"kind": "cli", "argv": small_argv(tmp, "colocated-k1", STEPS, K1)},
        {"kind": "cli", "argv": small_argv(tmp, "colocated-partial", 4, *PARTIAL)},
        {"kind": "cli", "argv": small_argv(tmp, "colocated-mt", STEPS, *EVAL, *MULTI_TURN)},
    ]
    code, out, _ = launch(DRIVER, tmp, 1, jobs, "co", 400)
    assert code == 0, out[-3000:]
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "split-lora", STEPS, *LORA, *SPLIT)},
        {"kind": "cli", "argv": small_argv(tmp, "split-k1", STEPS, K1, *SPLIT)},
        {"kind": "cli", "argv": small_argv(tmp, "split-partial", 4, *PARTIAL, *SPLIT)},
        {"kind": "cli", "argv": small_argv(tmp, "split-mt", STEPS, *EVAL, *MULTI_TURN, *SPLIT)},
    ]
    code, out, _ = launch(DRIVER, tmp, 3, jobs, "split", 600)
    assert code == 0, out[-3000:]
    return tmp


def test_a_split_generator_engine_equals_the_colocated_run(runs: Path) -> None:
    assert sum("eval/reward" in r for r in records(runs / "split")) == 3
    assert mismatched(runs / "split") == 0
    assert same(runs / "colocated", runs / "split")


def test_an_fp8_split_generator_engine_equals_the_colocated_run(runs: Path) -> None:
    """fp8: the split engine equals the colocated fp8 run, and each of its ranks (1 and 2) allocates no model-dtype
    weight for its fp8 projections (one element stands for them all), its copies filled by the first sync's
    model-dtype weights, quantized whole and cut to its rows on arrival, then by the fp8 syncs."""
    assert mismatched(runs / "split-fp8") == 0
    assert same(runs / "colocated-fp8", runs / "split-fp8")
    assert records(runs / "colocated-fp8") != records(runs / "colocated")
    for rank in (1, 2):
        mem = json.loads((runs / f"memory-fp8-rank{rank}.json").read_text())
        assert mem["fp8_copies"] > 0 and mem["received_as_weight"] == mem["fp8_copies"], mem
        assert mem["param_storage"] == mem["other_weights"] + 2 and mem["fp8_weights"] > 0, mem


def test_row_parallel_arithmetic_on_the_generators_is_caught(runs: Path) -> None:
    assert mismatched(runs / "planted") > 0


@pytest.mark.extended  # make test-all: the split generators' default-run checks are above
def test_lora_on_a_split_generator_engine_equals_the_colocated_run(more_runs: Path) -> None:
    assert mismatched(more_runs / "split-lora") == 0
    assert same(more_runs / "colocated-lora", more_runs / "split-lora")


@pytest.mark.extended
def test_one_step_off_on_a_split_generator_engine_equals_the_colocated_run(more_runs: Path) -> None:
    assert mismatched(more_runs / "split-k1") == 0
    assert same(more_runs / "colocated-k1", more_runs / "split-k1")


@pytest.mark.extended
def test_partial_rollouts_on_a_split_generator_engine_equal_the_colocated_run(more_runs: Path) -> None:
    # The generation cut by count runs on both generator ranks in the same order (the cut is the colocated one's);
    # groups left in flight are carried and resumed. (One trainer's share at this shape leaves no sample cut
    # mid-completion: test_partial_multirank.py's two trainers show that case on one-rank generators.)
    rows = [r for r in records(more_runs / "split-partial") if "offpolicy/partial/engine_steps" in r]
    assert rows and sum(r["offpolicy/partial/resumed_samples"] for r in rows) > 0
    assert mismatched(more_runs / "split-partial") == 0
    assert same(more_runs / "colocated-partial", more_runs / "split-partial")


@pytest.mark.extended
def test_multi_turn_episodes_on_a_split_generator_engine_equal_the_colocated_run(more_runs: Path) -> None:
    steps = [r for r in records(more_runs / "split-mt") if "env/turns_mean" in r]
    assert len(steps) == STEPS and all(r["env/turns_mean"] == 2 for r in steps)
    assert sum("eval/env/episodes" in r for r in records(more_runs / "split-mt")) == 3
    assert mismatched(more_runs / "split-mt") == 0
    assert same(more_runs / "colocated-mt", more_runs / "split-mt")
