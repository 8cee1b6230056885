"""The disaggregated layout on CPU ranks (gloo): generator ranks apart from trainer ranks change where samples are
generated, never the bits. A run of 3 ranks with distributed.generator_ranks = 1 (2 trainers) equals the colocated
run of 2 ranks step for step (every metric but timings) and in its final weights; a run whose trainers stop sending
weights after the first (the generators sample from stale weights) differs and its guard counts mismatches. A
disaggregated run resumed from its sharded checkpoint (the trainers' DCP) equals the uninterrupted one. The same
holds one step off (algorithm.max_off_policy_steps = 1), resume with its pending batch included. One step off, a
one-ulp fault in a generator's recorded logprobs is refused before any update uses the batch, under skip_step and
abort alike, though its guard verdict comes a step late (after the generators were asked for the next batch). In fp8
(model.precision = "fp8") the guard is at 0 colocated and disaggregated, and the two runs are equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._runs import COIN, REWARD, crashed_after, dynamic_argv, launch, mismatched, records, same, small_argv

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("_driver.py")
STEPS = 3
# Held-out evaluations before RL, after step 2 and after RL (trainer 0's generator runs them, the other trainer's
# rounds kept in step), and a checkpoint every step.
EVAL = ["task.num_eval=4", "task.eval_every=2", "train.save_every=1"]
# Two model turns around an observation, a reward that varies within a group (tests/envs/sample_envs.py).
MULTI_TURN = [
    "env.name=_mt_env:VaryingReward",
    "env.isolation=thread",
    "env.max_turns=2",
    "env.max_episode_tokens=64",
]
K1 = "algorithm.max_off_policy_steps=1"  # one step off: the generator samples batch t+1 while the trainers train
# LoRA with a KL reference (the base with the adapters off): the generator attaches the same adapters after the
# evaluation before RL, and each step's sync moves the adapters alone.
LORA = ("lora.rank=4", "algorithm.kl_coef=0.05")
FP8 = "model.precision=fp8"  # fp8 projections: the FSDP2 trainers, the colocated replicas and the generator quantize


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("disagg")
    (tmp / "reward.py").write_text(REWARD)
    disagg = ["distributed.generator_ranks=1"]
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "colocated", STEPS, *EVAL)},
        {"kind": "cli", "argv": small_argv(tmp, "colocated-k1", STEPS, *EVAL, K1)},
        {"kind": "cli", "argv": small_argv(tmp, "colocated-fp8", STEPS, *EVAL, FP8)},
    ]
    code, out, _ = launch(DRIVER, tmp, 2, jobs, "co", 400)
    assert code == 0, out[-3000:]
    jobs = [
        {
            "kind": "cli",
            "argv": small_argv(tmp, "disagg", STEPS, *EVAL, *disagg),
            "generator_memory": str(tmp / "memory-bf16.json"),
        },
        {"kind": "cli", "argv": small_argv(tmp, "disagg-k1", STEPS, *EVAL, *disagg, K1)},
        {
            "kind": "cli",
            "argv": small_argv(tmp, "disagg-fp8", STEPS, *EVAL, *disagg, FP8),
            "generator_memory": str(tmp / "memory-fp8.json"),
        },
        {
            "kind": "cli",
            "argv": small_argv(tmp, "stale", STEPS, *EVAL, *disagg, "run.on_mismatch=warn"),
            "skip_push": True,
        },
        # One step off with a fault in the generator's answer for step 2 (its guard deferred into step 2): skipped.
        {
            "kind": "cli",
            "argv": small_argv(tmp, "fault-skip", 2, *disagg, K1, "run.on_mismatch=skip_step"),
            "plant_generated": 2,
            "guard_log": str(tmp / "fault-skip.json"),
        },
    ]
    code, out, _ = launch(DRIVER, tmp, 3, jobs, "dis", 600)
    assert code == 0, out[-3000:]
    return tmp


@pytest.fixture(scope="module")
def aborted(tmp_path_factory) -> tuple[int, str, Path]:
    """The same fault under run.on_mismatch = "abort": the run stops at step 2 (a launch of its own: the job fails)."""
    tmp = tmp_path_factory.mktemp("disagg-abort")
    (tmp / "reward.py").write_text(REWARD)
    job = {
        "kind": "cli",
        "argv": small_argv(
            tmp, "fault-abort", 2, "distributed.generator_ranks=1", K1, "run.on_mismatch=abort"
        ),
        "plant_generated": 2,
        "guard_log": str(tmp / "fault-abort.json"),
    }
    code, out, _ = launch(DRIVER, tmp, 3, [job], "abort", 400)
    return code, out, tmp


@pytest.fixture(scope="module")
def resumed(runs: Path) -> Path:
    """make test-all (the default run resumes a disaggregated run in tests/distributed/test_partial_multirank.py):
    a crash after step 2's checkpoint (DCP over the two trainers), resumed in the same layout."""
    tmp = runs
    disagg = ["distributed.generator_ranks=1"]
    crashed_after(tmp / "disagg", tmp / "resumed", 2)
    crashed_after(tmp / "disagg-k1", tmp / "resumed-k1", 2)  # its checkpoint holds the pending batch
    jobs = [
        {"kind": "cli", "argv": small_argv(tmp, "resumed", STEPS, *EVAL, *disagg, resume=True)},
        {"kind": "cli", "argv": small_argv(tmp, "resumed-k1", STEPS, *EVAL, *disagg, K1, resume=True)},
    ]
    code, out, _ = launch(DRIVER, tmp, 3, jobs, "res", 400)
    assert code == 0, out[-3000:]
    return tmp


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> Path:
    """Dynamic sampling, LoRA and multi-turn episodes, colocated at world size 2 and with 1 generator + 2
    trainers."""
    tmp = tmp_path_factory.mktemp("disagg-variants")
    (tmp / "reward.py").write_text(REWARD)
    (tmp / "coin.py").write_text(COIN)
    lora = [
        {"kind": "cli", "argv": small_argv(tmp, "colocated-lora", STEPS, *EVAL, *LORA)},
        {"kind": "cli", "argv": small_argv(tmp, "colocated-lora-fp8", STEPS, *EVAL, *LORA, FP8)},
    ]
    mt = [
        {"kind": "cli", "argv": small_argv(tmp, "colocated-mt", STEPS, *EVAL, *MULTI_TURN)},
        {"kind": "cli", "argv": small_argv(tmp, "colocated-mt-k1", STEPS, *EVAL, *MULTI_TURN, K1)},
    ]
    code, out, _ = launch(DRIVER, tmp, 2, [dynamic_argv(tmp, "colocated-ds", STEPS), *lora, *mt], "co", 400)
    assert code == 0, out[-3000:]
    disagg = "distributed.generator_ranks=1"
    lora = [
        {"kind": "cli", "argv": small_argv(tmp, "disagg-lora", STEPS, *EVAL, disagg, *LORA)},
        {
            "kind": "cli",
            "argv": small_argv(tmp, "disagg-lora-fp8", STEPS, *EVAL, disagg, *LORA, FP8),
            "generator_memory": str(tmp / "memory-lora-fp8.json"),
        },
    ]
    mt = [
        {"kind": "cli", "argv": small_argv(tmp, "disagg-mt", STEPS, *EVAL, disagg, *MULTI_TURN)},
        {"kind": "cli", "argv": small_argv(tmp, "disagg-mt-k1", STEPS, *EVAL, disagg, *MULTI_TURN, K1)},
    ]
    code, out, _ = launch(
        DRIVER, tmp, 3, [dynamic_argv(tmp, "disagg-ds", STEPS, disagg), *lora, *mt], "dis", 400
    )
    assert code == 0, out[-3000:]
    return tmp


def test_disaggregated_equals_colocated_at_trainer_world_size(runs: Path) -> None:
    # the steps, and the evaluations before and after RL (the one after step 2 is in its record)
    assert len(records(runs / "colocated")) == STEPS + 2
    assert sum("eval/reward" in r for r in records(runs / "colocated")) == 3
    assert mismatched(runs / "disagg") == 0
    assert same(runs / "colocated", runs / "disagg")


def test_fp8_disaggregated_equals_colocated_guard_at_zero(runs: Path) -> None:
    """fp8 under torchrun: the guard at 0 colocated (2 FSDP2 ranks, each a replica) and with a generator rank, the
    two runs equal as in the model dtype; and not the model dtype's run (fp8 is on, nowhere falling back)."""
    assert mismatched(runs / "colocated-fp8") == 0 and mismatched(runs / "disagg-fp8") == 0
    assert all(r["mismatch/num_tokens"] > 0 for r in records(runs / "disagg-fp8") if "loss" in r)
    assert same(runs / "colocated-fp8", runs / "disagg-fp8")
    assert records(runs / "colocated-fp8") != records(runs / "colocated")


def test_an_fp8_generator_holds_no_model_dtype_projection_weights(runs: Path) -> None:
    """The fp8 run's generator (rank 2) allocates its weights but its fp8 projections' model-dtype ones (those
    share one element): the bf16 run's generator, the control, allocates every weight. Its first sync sent
    model-dtype weights (the warm start's), quantized into the fp8 copies on arrival; the run still equals the
    colocated one (above)."""
    fp8 = json.loads((runs / "memory-fp8-rank2.json").read_text())
    bf16 = json.loads((runs / "memory-bf16-rank2.json").read_text())
    assert fp8["fp8_copies"] > 0 and fp8["received_as_weight"] == fp8["fp8_copies"]
    assert fp8["param_storage"] == fp8["other_weights"] + 2  # one bf16 element
    assert bf16["fp8_copies"] == 0 and bf16["param_storage"] == bf16["other_weights"]
    assert bf16["param_storage"] - fp8["param_storage"] == fp8["fp8_weights"] - 2 > 0


@pytest.mark.extended
def test_disaggregated_resume_equals_the_uninterrupted_run(resumed: Path) -> None:
    assert same(resumed / "disagg", resumed / "resumed")
    # one step off: the checkpoint holds the pending batch
    assert same(resumed / "disagg-k1", resumed / "resumed-k1")


def test_one_step_off_disaggregated_equals_one_step_off_colocated(runs: Path) -> None:
    """k = 1: the generator samples batch t+1 from the weights of step t while the trainers train on batch t, as
    each colocated rank's engine copy does; every metric but timings and the final weights are the colocated run's
    at trainer world size 2 (resumed: test_disaggregated_resume_equals_the_uninterrupted_run, make test-all).
    Control: the one-step-off run is not the synchronous one (the comparison can fail)."""
    assert mismatched(runs / "disagg-k1") == 0
    steps = [r for r in records(runs / "disagg-k1") if "offpolicy/versions_behind/max" in r]
    assert len(steps) == STEPS and any(r["offpolicy/versions_behind/max"] > 0 for r in steps)
    assert same(runs / "colocated-k1", runs / "disagg-k1")
    assert not same(runs / "disagg", runs / "disagg-k1")


@pytest.mark.extended  # make test-all: the default run keeps k = 0, k = 1 and resume
def test_dynamic_sampling_disaggregated_equals_colocated(variants: Path) -> None:
    """The extra rounds of dynamic sampling go to the generator like the first: groups kept, dropped and resampled,
    metrics and weights are the colocated run's (and the run did resample: the comparison covers extra rounds)."""
    steps = [r for r in records(variants / "disagg-ds") if "dynamic_sampling/extra_rounds" in r]
    assert len(steps) == STEPS and sum(r["dynamic_sampling/extra_rounds"] for r in steps) > 0
    assert mismatched(variants / "disagg-ds") == 0
    assert same(variants / "colocated-ds", variants / "disagg-ds")


@pytest.mark.extended
def test_lora_disaggregated_equals_colocated_and_moves_the_adapters_alone(runs: Path, variants: Path) -> None:
    assert mismatched(variants / "disagg-lora") == 0
    assert same(variants / "colocated-lora", variants / "disagg-lora")
    full = [r["weight_sync/bytes"] for r in records(runs / "disagg") if "weight_sync/bytes" in r]
    lora = [r["weight_sync/bytes"] for r in records(variants / "disagg-lora") if "weight_sync/bytes" in r]
    assert len(lora) == STEPS and 0 < max(lora) < min(full) / 10


@pytest.mark.extended
def test_lora_on_an_fp8_generator_equals_colocated(variants: Path) -> None:
    """fp8 with LoRA: the generator attaches the adapters to projections it holds as their fp8 copies alone (no
    model-dtype weight), and the run equals the colocated fp8 LoRA run."""
    assert mismatched(variants / "disagg-lora-fp8") == 0
    assert same(variants / "colocated-lora-fp8", variants / "disagg-lora-fp8")
    assert records(variants / "colocated-lora-fp8") != records(variants / "colocated-lora")
    mem = json.loads((variants / "memory-lora-fp8-rank2.json").read_text())
    assert mem["fp8_copies"] > 0 and mem["param_storage"] == mem["other_weights"] + 2, mem


@pytest.mark.extended  # the "episodes" command by default: tests/distributed/test_disagg_episodes.py
def test_multi_turn_disaggregated_equals_colocated(variants: Path) -> None:
    """Episodes against an environment run on the generator (its own instance of the environment), the held-out
    evaluation's too: every metric and the final weights are the colocated run's at world size 2, every model token
    of every turn checked by the guard; one step off too (the generator runs the next batch's episodes while the
    trainers train). Control: the one-step-off run is not the synchronous one (the comparison can fail)."""
    for name in ("disagg-mt", "disagg-mt-k1"):
        assert mismatched(variants / name) == 0
        steps = [r for r in records(variants / name) if "env/turns_mean" in r]
        assert len(steps) == STEPS and all(r["env/turns_mean"] == 2 for r in steps)
        assert all(r["mismatch/num_tokens"] == r["mismatch/completion_tokens"] > 0 for r in steps)
        assert all(r["reward/std"] > 0 for r in steps)  # the advantages move the weights
    assert same(variants / "colocated-mt", variants / "disagg-mt")
    assert same(variants / "colocated-mt-k1", variants / "disagg-mt-k1")
    assert not same(variants / "disagg-mt", variants / "disagg-mt-k1")


def test_stale_generator_weights_differ_and_the_guard_sees_it(runs: Path) -> None:
    assert mismatched(runs / "stale") > 0
    assert not same(runs / "colocated", runs / "stale")


def _guard_log(tmp: Path, name: str) -> list[list[dict]]:
    """Each trainer rank's one-step-off steps: refused by the guard?, weights equal after the step to before?"""
    return [json.loads((tmp / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]


def _refused_untouched(ranks: list[list[dict]]) -> None:
    for rows in ranks:
        assert [(r["step"], r["refused"]) for r in rows] == [(1, False), (2, True)], rows
        # Step 1 trained (its weights moved: the comparison can fail); the refused step 2 left them as they were.
        assert not rows[0]["unchanged"] and rows[1]["unchanged"], rows


def test_a_refused_one_step_off_batch_is_never_trained_on_disaggregated(runs: Path) -> None:
    """A one-ulp fault in the generator's recorded logprobs of step 2's batch, whose guard is deferred into step 2
    (the generator already samples the next batch), under skip_step: the step is skipped and on every trainer rank
    the weights after it equal those before it (torch.equal)."""
    _refused_untouched(_guard_log(runs, "fault-skip"))
    skipped = [r for r in records(runs / "fault-skip") if "mismatch/num_mismatched_tokens" in r]  # the steps
    assert [r.get("mismatch/step_skipped", 0.0) for r in skipped] == [0.0, 1.0]
    assert skipped[1]["mismatch/num_mismatched_tokens"] >= 1


@pytest.mark.extended  # make test-all: the same refusal as skip_step's (a launch of its own: the job fails)
def test_a_refused_one_step_off_batch_aborts_before_any_update_disaggregated(aborted) -> None:
    code, out, tmp = aborted
    assert code != 0 and "no optimizer step was applied" in out, out[-3000:]
    _refused_untouched(_guard_log(tmp, "fault-abort"))
