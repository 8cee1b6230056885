"""`exactrl train` with a shared engine on CPU ranks (gloo, 2 ranks): `engine.tensor_parallel = 2` puts both ranks
on one engine split over them (exactrl/distributed/shared_engine.py), which samples the union of their prompts in one
call while each rank trains on its own share. The run equals the T = 1 run at the same world size step for step
(every metric but timings, the held-out evaluations included) and in its final weights (the checkpoint's policy/,
written from weights gathered whole), bit for bit; resumed at T = 2 from its step-2 checkpoint it equals the
uninterrupted run. The negative control plants Megatron's row-parallel arithmetic in the split engine's o_proj /
down_proj (partial sums over K slices): the run differs, and the guard counts the mismatched tokens. With LoRA
adapters on every projection (their B split with the projection, adapters alone synced after each update, a KL
reference of the base with the adapters off) T = 2 equals T = 1 the same way (make test-all), and a split engine
whose o_proj / down_proj drop their adapters is caught. Multi-turn episodes (make test-all) run in lockstep on the
group's ranks (exactrl/envs/rollout.py, "Lockstep"), each calling its own prompts' environment, the held-out
evaluation's too (rank 1 follows rank 0's episodes): T = 2 equals T = 1, and row-parallel arithmetic there is caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._runs import COIN, REWARD, crashed_after, dynamic_argv, launch, mismatched, records, same, small_argv
from .test_disagg import MULTI_TURN

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("_driver.py")
STEPS = 3
# Held-out evaluations before RL, after step 2 and after RL (rank 0 asks, rank 1 joins its group's call) and a
# checkpoint every step.
EVAL = ["task.num_eval=4", "task.eval_every=2", "train.save_every=1"]
TP = "engine.tensor_parallel=2"
LORA = ("lora.rank=4", "algorithm.kl_coef=0.05")
EP = "engine.expert_parallel=2"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("train-tp")
    (tmp / "reward.py").write_text(REWARD)
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "t1", STEPS, *EVAL)},
        {"kind": "cli", "argv": small_argv(tmp, "t2", STEPS, *EVAL, TP)},
        # One step is enough for the control (its first update's guard sees the difference).
        {
            "kind": "cli",
            "argv": small_argv(tmp, "planted", 1, TP, "run.on_mismatch=warn"),
            "plant": "row_parallel",
        },
    ]
    code, out, _ = launch(DRIVER, tmp, 2, jobs, "tp", 400)
    assert code == 0, out[-3000:]
    return tmp


@pytest.fixture(scope="module")
def resumed(runs: Path) -> Path:
    """make test-all: the T = 2 run crashed after its step-2 checkpoint and resumed at T = 2."""
    crashed_after(runs / "t2", runs / "resumed", 2)
    jobs = [{"kind": "cli", "argv": small_argv(runs, "resumed", STEPS, *EVAL, TP, resume=True)}]
    code, out, _ = launch(DRIVER, runs, 2, jobs, "tp-resume", 400)
    assert code == 0, out[-3000:]
    return runs


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("train-tp-lora")
    (tmp / "reward.py").write_text(REWARD)
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "t1", STEPS, *LORA, "train.save_every=1")},
        {"kind": "cli", "argv": small_argv(tmp, "t2", STEPS, *LORA, "train.save_every=1", TP)},
        {
            "kind": "cli",
            "argv": small_argv(tmp, "planted", 2, *LORA, TP, "run.on_mismatch=warn"),
            "plant": "adapters_off",
        },
    ]
    code, out, _ = launch(DRIVER, tmp, 2, jobs, "tp-lora", 400)
    assert code == 0, out[-3000:]
    return tmp


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory) -> Path:
    """DAPO's dynamic sampling (extra rounds of generation, the same number on every rank: the decision is
    global) and ReMax (a greedy rollout per prompt besides the sampled ones) with the shared engine."""
    tmp = tmp_path_factory.mktemp("train-tp-modes")
    (tmp / "reward.py").write_text(REWARD)
    (tmp / "coin.py").write_text(COIN)
    remax = "algorithm.advantage=remax"
    jobs = [
        dynamic_argv(tmp, "t1-ds", STEPS),
        dynamic_argv(tmp, "t2-ds", STEPS, TP),
        {"kind": "cli", "argv": small_argv(tmp, "t1-remax", STEPS, remax)},
        {"kind": "cli", "argv": small_argv(tmp, "t2-remax", STEPS, remax, TP)},
    ]
    code, out, _ = launch(DRIVER, tmp, 2, jobs, "tp-modes", 400)
    assert code == 0, out[-3000:]
    return tmp


@pytest.fixture(scope="module")
def mt_runs(tmp_path_factory) -> Path:
    """Multi-turn episodes (two model turns around an observation, tests/distributed/_mt_env.py) at T = 1 and T = 2,
    evaluations included, and the row-parallel control."""
    tmp = tmp_path_factory.mktemp("train-tp-mt")
    (tmp / "reward.py").write_text(REWARD)
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "t1", STEPS, *EVAL, *MULTI_TURN)},
        {"kind": "cli", "argv": small_argv(tmp, "t2", STEPS, *EVAL, *MULTI_TURN, TP)},
        {
            "kind": "cli",
            "argv": small_argv(tmp, "planted", 1, *MULTI_TURN, TP, "run.on_mismatch=warn"),
            "plant": "row_parallel",
        },
    ]
    code, out, _ = launch(DRIVER, tmp, 2, jobs, "tp-mt", 400)
    assert code == 0, out[-3000:]
    return tmp


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory) -> Path:
    """tiny-moe at world size 2: the engine's experts split over the two ranks (E = 2) against E = 1, and the
    control with the combine split over the ranks."""
    tmp = tmp_path_factory.mktemp("train-ep")
    (tmp / "reward.py").write_text(REWARD)
    moe = "model.preset=tiny-moe"
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "e1", STEPS, moe)},
        {"kind": "cli", "argv": small_argv(tmp, "e2", STEPS, moe, EP)},
        {
            "kind": "cli",
            "argv": small_argv(tmp, "planted", 1, moe, EP, "run.on_mismatch=warn"),
            "plant": "partial_combine",
        },
    ]
    code, out, _ = launch(DRIVER, tmp, 2, jobs, "ep", 400)
    assert code == 0, out[-3000:]
    return tmp


def test_a_shared_engine_trains_as_one_engine_per_rank(runs: Path) -> None:
    assert len(records(runs / "t2")) == STEPS + 2  # the steps and the evaluations before and after RL
    assert sum("eval/reward" in r for r in records(runs / "t2")) == 3
    assert mismatched(runs / "t2") == 0
    assert same(runs / "t1", runs / "t2")


@pytest.mark.extended  # make test-all: resume itself is the same DCP path as at T = 1 (tested by default)
def test_a_shared_engine_resumes_bitwise(resumed: Path) -> None:
    assert same(resumed / "t2", resumed / "resumed")


def test_row_parallel_arithmetic_in_the_shared_engine_is_caught(runs: Path) -> None:
    assert mismatched(runs / "planted") > 0
    first = [r for r in records(runs / "t1") if r.get("step") == 1 and "loss" in r]
    planted = [r for r in records(runs / "planted") if r.get("step") == 1 and "loss" in r]
    assert len(first) == len(planted) == 1 and first != planted


@pytest.mark.extended  # make test-all: the engine's LoRA split is in the default run (test_tensor_parallel.py)
def test_lora_adapters_split_with_their_projections_train_as_one_engine(lora_runs: Path) -> None:
    assert mismatched(lora_runs / "t2") == 0
    assert same(lora_runs / "t1", lora_runs / "t2")
    # The control: B is zero until the first update, so step 2 is the first whose adapters change the samples.
    assert mismatched(lora_runs / "planted") > 0


@pytest.mark.extended  # make test-all: the shared engine's default-run checks are above
def test_dynamic_sampling_and_remax_with_a_shared_engine_equal_one_engine_per_rank(mode_runs: Path) -> None:
    for mode in ("ds", "remax"):
        assert mismatched(mode_runs / f"t2-{mode}") == 0, mode
        assert same(mode_runs / f"t1-{mode}", mode_runs / f"t2-{mode}"), mode
    # the dynamic runs dropped groups and sampled extra rounds (the path is exercised)
    assert any(r.get("dynamic_sampling/extra_rounds", 0) > 0 for r in records(mode_runs / "t2-ds"))


@pytest.mark.extended  # make test-all: tensor parallel keeps the default run's shared-engine checks
def test_expert_parallel_trains_as_one_engine_and_a_split_combine_is_caught(ep_runs: Path) -> None:
    assert mismatched(ep_runs / "e2") == 0
    assert same(ep_runs / "e1", ep_runs / "e2")
    assert mismatched(ep_runs / "planted") > 0


@pytest.mark.extended  # make test-all: the lockstep itself is in the default run (tests/envs/test_lockstep.py)
def test_multi_turn_episodes_on_a_shared_engine_equal_one_engine_per_rank(mt_runs: Path) -> None:
    steps = [r for r in records(mt_runs / "t2") if "env/turns_mean" in r]
    assert len(steps) == STEPS and all(r["env/turns_mean"] == 2 for r in steps)
    assert all(r["mismatch/num_tokens"] == r["mismatch/completion_tokens"] > 0 for r in steps)
    assert sum("eval/env/episodes" in r for r in records(mt_runs / "t2")) == 3  # rank 1 followed rank 0's
    assert mismatched(mt_runs / "t2") == 0
    assert same(mt_runs / "t1", mt_runs / "t2")
    assert mismatched(mt_runs / "planted") > 0
