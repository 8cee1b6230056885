"""`exactrl bench rl` end to end on the CPU at tiny scale, and the seeded length plan it gives the engine."""

import json

import numpy as np
import pytest
import torch

from exactrl.bench_rl import PlannedLengthEngine, Workload
from exactrl.cli import main
from exactrl.engine.engine import EngineConfig
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset

KEYS = [
    "step_s",
    "generate_s",
    "reward_s",
    "train_s",
    "weight_sync_s",
    "idle_s",
    "tokens_per_s",
    "generate_tokens_per_s",
    "generated_tokens",
    "step_s_all",
    "trace",
    "plot",
    "engine_steps",
    "mismatch_num_mismatched_tokens",
]


# `bench rl` at tiny scale on the CPU: 2 prompts x 2 samples, 1 warm-up + 2 timed steps.
TINY = (
    "bench rl --preset tiny --device cpu --dtype float32 --prompts 2 --samples 2 --prompt-min 4 "
    "--prompt-max 8 --max-tokens 12 --completion-median 6 --steps 2 --max-num-seqs 8 "
    "--tokens-per-microbatch 64"
).split()


def test_bench_rl_runs_the_loop_step_and_its_stages_add_up(tmp_path, capsys, monkeypatch):
    from exactrl.train.loop import RLRun

    drivers = []  # the run's step driver is built once, with the benchmark's engine, prompts and timers in place
    real = RLRun.make_driver
    monkeypatch.setattr(RLRun, "make_driver", lambda run: drivers.append(real(run)) or drivers[-1])
    assert main([*TINY, "--out-dir", str(tmp_path)]) == 0
    assert len(drivers) == 1
    (path,) = tmp_path.glob("rl-tiny-exact-cpu.json")
    rec = json.loads(path.read_text())
    # The step's prompts are the workload's (2 prompts of 4 to 8 tokens, their lengths drawn first from the seed),
    # not the task's.
    wl = Workload.draw(
        prompts=2,
        samples=2,
        prompt_min=4,
        prompt_max=8,
        completion_median=6,
        completion_sigma=0.5,
        max_tokens=12,
        vocab=2,
    )
    assert rec["prompt_tokens"] == 2 * sum(len(p) for p in wl.prompt_ids)  # each of a group's 2 rollouts
    assert all(k in rec for k in KEYS), [k for k in KEYS if k not in rec]
    assert (tmp_path / "rl-tiny-exact-cpu.png").stat().st_size > 0
    assert rec["timed_steps"] == 2 and rec["warmup_steps"] == 1 and rec["step_s"] in rec["step_s_all"]
    assert rec["partial"] is False and rec["preemptions"] == 0 and rec["kv_cache_tokens"] > 0
    stages = rec["generate_s"] + rec["reward_s"] + rec["train_s"] + rec["weight_sync_s"]
    assert rec["generate_s"] > 0 and rec["train_s"] > 0 and rec["reward_s"] > 0
    # Timed stages never overlap and miss nothing big: what is left (prompts, metrics) is small and not negative.
    assert 0 <= rec["idle_s"] <= 0.25 * rec["step_s"]
    assert stages + rec["idle_s"] == pytest.approx(rec["step_s"], rel=1e-9)
    # The trace: one point per engine step of the step's generate call, inside it; the 2 prompts were prefilled
    # together, then up to 4 samples ran at once (a sample planned to 1 token ends as it forks).
    tr = rec["trace"]
    assert len(tr) == rec["engine_steps"] > 0
    assert all(0 <= t <= rec["generate_s"] for t, _, _ in tr)
    assert tr[0][1:] == [2, 0] and 2 < max(r for _, r, _ in tr) <= 4
    assert (
        rec["mismatch_num_mismatched_tokens"] == 0 and rec["mismatch_num_tokens"] == rec["generated_tokens"]
    )
    out = capsys.readouterr().out
    # One median, one definition: the table's "step_s (median step)", the JSON's step_s and step_s_median are the
    # same step's (of 2 timed steps the lower, a step that ran: the mean of the two would be neither).
    assert rec["step_s_median"] == rec["step_s"] == sorted(rec["step_s_all"])[0]
    assert f"{'step_s (median step)':30} {rec['step_s_median']:.4g}" in out.splitlines()
    line = json.loads(out.strip().splitlines()[-1])  # the printed line leaves the trace out
    assert line["step_s"] == rec["step_s"] and "trace" not in line and line["trace_points"] == len(tr)
    # Earlier results (e.g. exact and fast) drawn on one plot without running anything.
    assert (
        main(["bench", "rl", "--plot-from", str(path), str(path), "--plot", str(tmp_path / "two.png")]) == 0
    )
    assert (tmp_path / "two.png").stat().st_size > 0


def test_set_overrides_the_runs_config_and_the_record_says_so(tmp_path, capsys):
    """`bench rl --set SECTION.KEY=VALUE` reaches the run (here activation checkpointing and an fp32 LM head, which
    keep the bits: 0 mismatched) and the record carries the keys, the model's depth and the engine's split; a key
    that does not exist is refused by name before anything runs."""
    sets = ["--set", "train.activation_checkpointing=true", "--set", "model.fp32_lm_head=true"]
    assert main([*TINY, "--out-dir", str(tmp_path), *sets]) == 0
    (path,) = tmp_path.glob("rl-tiny-exact-cpu.json")
    rec = json.loads(path.read_text())
    assert rec["overrides"] == ["train.activation_checkpointing=true", "model.fp32_lm_head=true"]
    assert (
        rec["num_layers"] == preset("tiny").num_layers
        and rec["tensor_parallel"] == 1
        and rec["expert_parallel"] == 1
    )
    assert rec["mismatch_num_mismatched_tokens"] == 0 and rec["mismatch_num_tokens"] > 0
    capsys.readouterr()
    assert main([*TINY, "--out-dir", str(tmp_path / "bad"), "--set", "train.no_such_key=1"]) != 0
    assert "unknown key 'train.no_such_key'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").glob("*.json"))


def test_profile_times_the_last_steps_generate_and_leaves_it_out_of_the_median(tmp_path, capsys):
    assert main([*TINY, "--profile", "--out-dir", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "rl-tiny-exact-cpu.json").read_text())
    detail = rec["steps_detail"]
    assert [d.get("profiled", False) for d in detail] == [False, True]
    assert rec["step_s"] == detail[0]["step_s"] and rec["profiled_generate_s"] == detail[1]["generate_s"]
    ops = {k["kernel"] for k in rec["generate_kernels"]}
    assert "aten::mm" in ops or "aten::addmm" in ops, sorted(ops)[:20]
    assert all(k["ms"] >= 0 and k["count"] > 0 for k in rec["generate_kernels"])
    assert "CPU time by operator" in capsys.readouterr().out


def test_workload_lengths_are_seeded_long_tailed_and_capped():
    kw = dict(
        prompts=64,
        samples=8,
        prompt_min=64,
        prompt_max=512,
        completion_median=384,
        completion_sigma=0.8,
        max_tokens=2048,
        vocab=1000,
    )
    a, b, c = Workload.draw(**kw), Workload.draw(**kw), Workload.draw(**kw, seed=1)
    assert np.array_equal(a.max_tokens, b.max_tokens) and a.prompt_ids == b.prompt_ids
    assert not np.array_equal(a.max_tokens, c.max_tokens)
    lens = a.max_tokens
    assert lens.shape == (64, 8) and lens.min() >= 1 and lens.max() == 2048
    assert 300 < np.median(lens) < 480 and lens.mean() > np.median(lens)  # a long right tail
    assert all(64 <= len(p) <= 512 for p in a.prompt_ids)
    with pytest.raises(ValueError, match="--prompt-max"):
        Workload.draw(**{**kw, "prompt_max": 10})


def test_each_sample_stops_at_its_planned_length():
    wl = Workload.draw(
        prompts=3,
        samples=3,
        prompt_min=2,
        prompt_max=9,
        completion_median=5,
        completion_sigma=1.0,
        max_tokens=16,
        vocab=256,
    )
    assert len(set(wl.max_tokens.ravel().tolist())) > 3
    model = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0)
    eng = PlannedLengthEngine(model, EngineConfig(), workload=wl)
    # request ids of a later RL step (step * prompts + index) map to the same plan
    outs = eng.generate(wl.prompt_ids, SamplingParams(max_tokens=16, n=3), request_ids=[3, 4, 5])
    got = [[len(s.token_ids) for s in o.samples] for o in outs]
    assert got == wl.max_tokens.tolist()
    assert all(s.finish_reason == "length" for o in outs for s in o.samples)


def test_stage_memory_peaks_are_credited_to_every_open_stage_and_the_step():
    """bench rl's per-stage device-memory peaks (beside the plan's phases): the allocator's peak is read and
    restarted at each stage boundary; a stage nested in another (the weight sync inside an update) counts for both.
    A fake allocator stands in for CUDA's."""
    from types import SimpleNamespace

    from exactrl.bench_rl import _StageTimers

    high = [0]  # the fake allocator's peak since its last reset

    def use(n: int) -> None:
        high[0] = max(high[0], n)

    from exactrl.train.hooks import RunHooks

    parallel = SimpleNamespace(sync_weights=lambda: use(25))

    def update():
        use(20)
        parallel.sync_weights()  # the wrapped one: nested in the update stage

    run = SimpleNamespace(
        parallel=parallel,
        stages=SimpleNamespace(rollout=lambda: use(10), rank_scores=lambda: use(3), update=update),
    )
    timers = _StageTimers("cpu")
    RunHooks(wrap_stage=timers.wrap).wrap({"stages": run.stages, "parallel": parallel})  # as RLRun does
    assert timers.memory is None  # CPU: nothing measured
    timers.memory = (lambda: high[0], lambda: high.__setitem__(0, 0))
    timers.start_step()
    use(7)  # before any stage: the step's, no stage's
    run.stages.rollout()
    run.stages.rank_scores()
    run.stages.update()
    assert timers.stage_peaks == {"generate_s": 10, "reward_s": 3, "train_s": 25, "weight_sync_s": 25}
    assert timers.bank_memory() == 25
    timers.start_step()
    run.stages.rank_scores()
    assert timers.stage_peaks == {"reward_s": 3} and timers.peak == 3
