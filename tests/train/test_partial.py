"""Partial rollouts (algorithm.partial_rollouts, max_off_policy_steps = 2): generation cut by count, unfinished
samples carried to the next generation and resumed by recompute under the new weights, every token checked under
the version that sampled it.

The engine half runs on a tiny random model without training: a cut and a resume under the same weights give the
uninterrupted generation bit for bit; after a weight change the recompute path passes the guard, while extending the
KV of the old weights (the planted bug) does not. The loop half runs a few steps of the tiny preset with a hashed
reward; a sample's length varies because a tenth of the byte vocabulary are stop tokens (a random model never stops
on its own), so groups finish at different engine steps and the cut leaves some samples unfinished.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rl_runs import run_config
from rl_runs import steps as _steps
from rl_runs import untimed as _untimed
from rl_runs import weights as _weights

import exactrl.engine.partial as engine_partial
import exactrl.train.loop as loop_mod
from exactrl.config import ConfigError
from exactrl.engine.block_manager import BlockManager
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.partial import PartialGeneration, PartialSample
from exactrl.engine.sampler import SamplingParams
from exactrl.engine.scheduler import Scheduler
from exactrl.engine.sequence import Sequence
from exactrl.model import build_model, preset
from exactrl.train.drivers.offpolicy import OneStepOffDriver
from exactrl.train.loop import RLRun, train
from exactrl.train.offpolicy import BehaviourPolicy, check_batch
from exactrl.train.partial import PARTIAL_FILE, PartialRollouts
from exactrl.train.stages import RunStages
from exactrl.train.trainer import MismatchError, Rollout

STOP = list(range(0, 256, 5))  # about a fifth of the byte tokens: lengths spread up to max_tokens

REWARD = """
import hashlib

def hashed(completion, answer, example):
    return (int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5) / 4
"""


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- the engine: cut, export, readmit ----------------------------------------------------------------------------

PROMPTS = [[11, 40, 73, 9], [5, 6, 7], [100, 101, 102, 103, 104, 105], [33, 34], [250, 3, 18, 44, 91], [61]]
IDS = [7, 8, 9, 10, 11, 12]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.9, max_tokens=24, n=2, seed=3, stop_token_ids=STOP)


def _engine(model) -> RolloutEngine:
    # A few sequences at a time: at the cut some groups are still waiting (not forked), some mid-completion.
    return RolloutEngine(model, EngineConfig(max_num_seqs=4, prefill_chunk_size=4, max_model_len=64))


def _key(s: PartialSample) -> tuple[int, int]:
    return s.request_id, s.sample_index


def _cut_after(gen: PartialGeneration, steps: int) -> tuple[list[PartialSample], list[PartialSample]]:
    """(finished, unfinished) after `steps` engine steps and the cut."""
    done: list[PartialSample] = []
    for _ in range(steps):
        done += gen.step()[1]
    rest = gen.cut()
    return done + [s for s in rest if s.finished], [s for s in rest if not s.finished]


def _finish(gen: PartialGeneration) -> list[PartialSample]:
    done: list[PartialSample] = []
    more = True
    while more:
        more, finished = gen.step()
        done += finished
    return done + gen.cut()


def test_cut_and_resume_is_the_uninterrupted_generation():
    """Same weights: a sample cut and resumed (KV recomputed in another call) draws what it would have drawn, with
    the same recorded logprobs, bit for bit; so does a group cut before its prompt was prefilled."""
    eng = _engine(build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0))
    ref = {
        (o.request_id, j): s
        for o in eng.generate(PROMPTS, _params(), request_ids=IDS)
        for j, s in enumerate(o.samples)
    }
    done, cut = _cut_after(PartialGeneration(eng, PROMPTS, IDS, _params()), 9)
    assert any(s.completion_ids for s in cut), "the cut was meant to leave samples mid-completion"
    assert any(not s.completion_ids for s in cut), "and groups that had not started"
    again = _finish(PartialGeneration(eng, [], [], _params(), resumed=cut))
    got = {_key(s): s for s in done + again}
    assert got.keys() == ref.keys() and all(s.finished for s in got.values())
    for k, r in ref.items():
        assert got[k].completion_ids == r.token_ids, k
        assert torch.equal(torch.tensor(got[k].rollout_logprobs, dtype=torch.float32), r.rollout_logprobs), k
        assert got[k].finish_reason == r.finish_reason
    # Negative control: resumed under another seed, the continuations differ (the comparison can fail).
    other = SamplingParams(temperature=0.9, max_tokens=24, n=2, seed=4, stop_token_ids=STOP)
    _, cut = _cut_after(PartialGeneration(eng, PROMPTS, IDS, _params()), 9)
    moved = {_key(s): s for s in _finish(PartialGeneration(eng, [], [], other, resumed=cut))}
    assert any(moved[k].completion_ids != ref[k].token_ids for k in moved)


def _perturb(model: torch.nn.Module) -> None:
    """An update's worth of change, the same every time (seeded)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def _checks(samples: list[PartialSample], since: dict[tuple[int, int], int]) -> list[Rollout]:
    """The tokens sampled after the refresh, as the guard scores them: earlier tokens are context."""
    out = []
    for s in samples:
        j = since.get(_key(s), 0)
        if len(s.completion_ids) > j:
            out.append(
                Rollout(
                    prompt_ids=s.prompt_ids + s.completion_ids[:j],
                    completion_ids=s.completion_ids[j:],
                    rollout_logprobs=torch.tensor(s.rollout_logprobs[j:], dtype=torch.float32),
                    request_id=s.request_id,
                    sample_index=s.sample_index,
                )
            )
    return out


def _behaviour() -> tuple[torch.nn.Module, BehaviourPolicy, RolloutEngine]:
    policy = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0)
    copy = BehaviourPolicy(policy, version=0)
    return policy, copy, _engine(copy.model)


def test_resume_after_a_refresh_recomputes_and_old_kv_is_caught():
    # The right path: cut, check the tokens of version 0 under version 0, refresh, resume (recompute), check the
    # new tokens under version 1.
    policy, copy, eng = _behaviour()
    done, cut = _cut_after(PartialGeneration(eng, PROMPTS, IDS, _params()), 9)
    _, err = check_batch(copy, _checks(done + cut, {}), 0.9, 4096)
    assert err is None
    since = {_key(s): len(s.completion_ids) for s in cut}
    _perturb(policy)
    copy.refresh(1)
    again = _finish(PartialGeneration(eng, [], [], _params(), resumed=cut))
    checks = _checks(again, since)
    assert any(since[_key(s)] for s in again if s.completion_ids[since[_key(s)] :]), "a sample spans versions"
    m, err = check_batch(copy, checks, 0.9, 4096)
    assert err is None and m["mismatch/num_tokens"] > 0

    # The planted bug: the same generation goes on after the refresh, extending KV written under version 0.
    policy, copy, eng = _behaviour()
    gen = PartialGeneration(eng, PROMPTS, IDS, _params())
    done = []
    for _ in range(9):
        done += gen.step()[1]
    inner = gen._gen
    if inner.pending is not None:  # the step in flight was sampled by version 0
        inner.settle(inner.pending)
        inner.pending = None
    live = [*inner.sched.running, *inner.sched.waiting]
    since = {(s.request_id, s.sample_index): s.num_completion_tokens for s in live if s.num_samples == 1}
    _perturb(policy)
    copy.refresh(1)
    rest = _finish(gen)
    m, err = check_batch(copy, _checks(rest, since), 0.9, 4096)
    assert isinstance(err, MismatchError) and m["mismatch/num_mismatched_tokens"] > 0
    assert "policy version 1" in str(err)


def test_readmit_refuses_what_it_cannot_resume():
    sched = Scheduler(BlockManager(8, 16), max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=16)
    seq = Sequence(0, 1, [1, 2, 3], max_tokens=4)
    seq.token_ids += [4, 5]
    with pytest.raises(ValueError, match="2 generated tokens with 0 logprobs"):
        sched.readmit(seq)
    seq.rollout_logprobs = [-1.0, -2.0]
    sched.readmit(seq)
    assert sched.waiting[0] is seq
    group = Sequence(1, 2, [1, 2], max_tokens=4, num_samples=2)
    with pytest.raises(ValueError, match="num_samples = 1"):
        sched.readmit(group)
    with pytest.raises(ValueError, match="both new and resumed"):
        eng = _engine(build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0))
        PartialGeneration(eng, [[1, 2]], [3], _params(), [PartialSample(3, 0, [1, 2], [5], [-1.0], 4)])


# -- the loop ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "rw.py"
    path.write_text(REWARD)
    return path


def _cfg(tmp_path: Path, reward: Path, out: str = "run", **over):
    d = {
        "run": {
            "name": "p",
            "seed": 0,
            "device": "cpu",
            "tensorboard": False,
            "report": False,
            "progress": False,
        },
        "model": {"preset": "tiny", "dtype": "float32"},
        "engine": {"block_size": 16, "max_model_len": 64},
        "sampling": {"temperature": 0.8, "max_tokens": 32, "stop_token_ids": STOP},
        "task": {
            "name": "arithmetic",
            "arithmetic_max_operand": 30,
            "use_chat_template": False,
            "num_eval": 0,
            "eval_every": 0,
            "max_prompt_tokens": 16,
        },
        "reward": {"functions": [f"{reward}:hashed"]},
        "algorithm": {
            "name": "grpo",
            "group_size": 4,
            "rollouts_per_step": 16,
            "max_off_policy_steps": 2,
            "partial_rollouts": True,
            "partial_oversample": 1.0,
        },
        "train": {"steps": 4, "lr": 3e-4, "save_every": 1, "keep_checkpoints": 5},
        "sft": {"steps": 0},
    }
    return run_config(d, over, tmp_path / out)


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory, reward_path):
    tmp = tmp_path_factory.mktemp("partial")
    s = train(_cfg(tmp, reward_path), out=lambda *a: None)
    return tmp, s


def test_partial_is_exact_across_refreshes(partial_run):
    tmp, s = partial_run
    rows = _steps(tmp / "run")
    assert len(rows) == 4 and s["mismatched_tokens_total"] == 0
    assert all(r["mismatch/num_mismatched_tokens"] == 0 for r in rows)
    # Samples really were cut and resumed under newer weights: some trained sequence holds tokens of two versions,
    # its first ones two versions behind (the bound, never beyond).
    assert sum(r["offpolicy/partial/recomputed_tokens"] for r in rows) > 0
    assert max(r["offpolicy/mixed_version_seqs"] for r in rows) > 0
    assert max(r["offpolicy/versions_behind/max"] for r in rows) == 2
    assert all(r["offpolicy/versions_behind/max"] <= 2 for r in rows)
    assert all(r["optimizer_steps"] == 1 for r in rows)
    # The guard compared every token it was given in the generation that sampled it (the trained batch's and the
    # carried samples' new tokens): more than zero in every generation that ran the engine.
    assert all(r["mismatch/num_tokens"] > 0 for r in rows if r["offpolicy/partial/engine_steps"] > 0)
    assert (tmp / "run" / "checkpoints" / "step-000002" / PARTIAL_FILE).is_file()


def test_the_step_line_says_how_many_of_the_trained_batch_were_checked(partial_run):
    """The guard's mismatch/num_tokens counts this generation's sampled tokens (batch and carried), which is not
    the batch trained: the line and the metrics say both, and tok/s is the generation's own (sampled tokens over
    its time); the off-policy figures reach the line and report.png."""
    pytest.importorskip("matplotlib")
    from exactrl.report import report_figure
    from exactrl.train.logging import step_line

    tmp, _ = partial_run
    rows = _steps(tmp / "run")
    assert any(r["mismatch/num_tokens"] != r["num_tokens"] for r in rows)  # the two counts do differ
    assert any(r["mismatch/batch_tokens_checked_earlier"] > 0 for r in rows)  # carried tokens were trained
    for r in rows:
        assert r["mismatch/batch_tokens"] == r["num_tokens"]  # the tokens trained (single-turn: all of them)
        assert 0 <= r["mismatch/batch_tokens_checked_earlier"] <= r["num_tokens"]
        assert r["offpolicy/partial/sampled_tokens"] == r["mismatch/num_tokens"]
        assert r["perf/tokens_per_s"] * r["perf/generate_s"] == pytest.approx(
            r["offpolicy/partial/sampled_tokens"]
        )
        line = step_line(r)
        n, e = int(r["num_tokens"]), int(r["mismatch/batch_tokens_checked_earlier"])
        assert f"sampled, batch {n} checked ({e} earlier)" in line and "tok/s sampled" in line
        assert f"| behind {r['offpolicy/versions_behind/token_mean']:.2f} (max " in line and " is-w " in line
    fig = report_figure(rows)
    ax = next(a for a in fig.axes if a.get_title().startswith("off-policy"))
    curves = {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}
    assert curves["versions behind (max)"] == [r["offpolicy/versions_behind/max"] for r in rows]


def test_partial_same_seed_same_run(partial_run, tmp_path, reward_path):
    tmp, _ = partial_run
    train(_cfg(tmp_path, reward_path), out=lambda *a: None)
    assert _untimed(_steps(tmp / "run")) == _untimed(_steps(tmp_path / "run"))
    a, b = _weights(tmp / "run", 4), _weights(tmp_path / "run", 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_partial_resume_is_bitwise(partial_run, tmp_path, reward_path, monkeypatch):
    """Stopped after step 1 (as by a signal), resumed: the pending batch and the samples in flight come back from
    the checkpoint (the next generation resumes them), and steps 2-4 are the uninterrupted run's, weights and
    metrics."""
    tmp, _ = partial_run
    cfg = _cfg(tmp_path, reward_path)
    monkeypatch.setattr(RLRun, "stop_requested", lambda self: self.step == 1)
    s = train(cfg, out=lambda *a: None)
    assert s["rl_steps"] == 1
    held = json.loads((tmp_path / "run" / "checkpoints" / "step-000001" / PARTIAL_FILE).read_text())
    cut = [
        s for g in held["pool"] for s in g["samples"] if s["completion_ids"] and s["finish_reason"] is None
    ]
    assert cut, "the checkpoint was meant to hold samples cut mid-completion"
    monkeypatch.undo()
    s = train(cfg, resume=True, out=lambda *a: None)
    assert s["rl_steps"] == 4 and s["mismatched_tokens_total"] == 0
    assert _untimed(_steps(tmp_path / "run")) == _untimed(_steps(tmp / "run"))
    a, b = _weights(tmp / "run", 4), _weights(tmp_path / "run", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_into_the_synchronous_loop_says_what_it_drops(tmp_path, reward_path, monkeypatch):
    """Stopped after step 1 of a partial run (a batch sampled ahead and groups in flight in the checkpoint), then
    resumed with partial rollouts off under --allow-config-change: the run says both are dropped, not in silence."""
    from exactrl.train.offpolicy import PENDING_FILE
    from exactrl.train.rundir import check_run_dir

    monkeypatch.setattr(RLRun, "stop_requested", lambda self: self.step == 1)
    train(_cfg(tmp_path, reward_path), out=lambda *a: None)
    monkeypatch.undo()
    ck = tmp_path / "run" / "checkpoints" / "step-000001"
    assert (ck / PENDING_FILE).is_file() and json.loads((ck / PARTIAL_FILE).read_text())["pool"]
    sync = _cfg(
        tmp_path,
        reward_path,
        algorithm__partial_rollouts=False,
        algorithm__max_off_policy_steps=0,
        train__steps=2,
    )
    plan = check_run_dir(sync, resume=True, allow_config_change=True)
    lines: list[str] = []
    s = train(sync, resume=True, run_dir=plan, out=lambda *a: lines.append(" ".join(map(str, a))))
    assert s["rl_steps"] == 2
    said = "\n".join(lines)
    assert "the checkpoint holds the batch sampled ahead" in said and "that batch is dropped" in said
    assert "prompt group(s) in flight (partial rollouts)" in said and "they are dropped" in said


def _plant_at_second_cut(monkeypatch, mark) -> None:
    """The second generation (the worker's, during step 1's update) records one logprob one ulp off: the first token
    of a sample it cuts, one this generation started (so every token of it is this generation's)."""
    cuts: list[list[PartialSample]] = []
    original = engine_partial.PartialGeneration.cut

    def cut(self):
        out = original(self)
        cuts.append(out)
        if len(cuts) == 2:
            carried = {_key(s) for s in cuts[0] if not s.finished}
            s = next(s for s in out if not s.finished and s.completion_ids and _key(s) not in carried)
            s.rollout_logprobs[0] = float(
                torch.nextafter(torch.tensor(s.rollout_logprobs[0]), torch.tensor(0.0))
            )
            mark(s)
        return out

    monkeypatch.setattr(engine_partial.PartialGeneration, "cut", cut)


def test_one_ulp_in_a_carried_prefix_is_caught_before_the_update(tmp_path, reward_path, monkeypatch):
    """The second generation (the worker's, during step 1's update) records one logprob of a sample it cuts one ulp
    off: its guard refuses step 2's batch before any update uses it, and names that sample."""
    marked: dict[str, int] = {}
    _plant_at_second_cut(
        monkeypatch, lambda s: marked.update(request_id=s.request_id, sample_index=s.sample_index)
    )
    seen = {}
    refuse = OneStepOffDriver.refuse

    def spy(self, step, batch):
        seen["weights"] = {k: v.detach().clone() for k, v in self.ctx.trainer.model.state_dict().items()}
        return refuse(self, step, batch)

    monkeypatch.setattr(OneStepOffDriver, "refuse", spy)
    with pytest.raises(MismatchError) as err:
        train(_cfg(tmp_path, reward_path), out=lambda *a: None)
    msg = str(err.value)
    assert "step 2" in msg and "no optimizer step was applied" in msg
    assert f"request {marked['request_id']}, sample {marked['sample_index']}" in msg
    assert marked, "the plant was meant to hit a cut sample"
    run = tmp_path / "run"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000001"
    saved = _weights(run, 1)
    named = {k: v for k, v in seen["weights"].items() if k in saved}
    assert named and all(torch.equal(saved[k], v) for k, v in named.items())
    report = json.loads((run / "mismatch-000002" / "report.json").read_text())
    assert [(q["request_id"], q["sample_index"]) for q in report["sequences"]] == [
        (marked["request_id"], marked["sample_index"])
    ]


def test_skip_step_drops_the_carried_group_it_refused(tmp_path, reward_path, monkeypatch):
    """run.on_mismatch = "skip_step": the refused batch is not trained, and the carried group holding the bad
    logprob leaves the pool, so no later update uses it either; the run goes on, exact."""
    marked: list[int] = []
    _plant_at_second_cut(monkeypatch, lambda s: marked.append(s.request_id))
    trained: list[int] = []
    update = RunStages.update

    def spy(self, step, rollouts, **kw):
        trained.extend(r.request_id for r in rollouts)
        return update(self, step, rollouts, **kw)

    monkeypatch.setattr(RunStages, "update", spy)
    s = train(_cfg(tmp_path, reward_path, run__on_mismatch="skip_step"), out=lambda *a: None)
    rows = {r["step"]: r for r in _steps(tmp_path / "run")}
    assert rows[2]["mismatch/step_skipped"] == 1 and rows[2]["optimizer_steps"] == 0
    assert rows[2]["offpolicy/partial/guard_dropped_groups"] == 1
    assert s["mismatched_tokens_total"] == 1 and rows[4]["optimizer_steps"] == 1
    assert marked and marked[0] not in trained


def test_partial_off_leaves_one_step_off_alone(tmp_path, reward_path, monkeypatch):
    """k = 1 without partial rollouts: the partial machinery never runs and the step records carry no new key."""

    def refuse(*a, **k):
        raise AssertionError("partial rollouts ran with algorithm.partial_rollouts = false")

    monkeypatch.setattr(PartialRollouts, "batch", refuse)
    monkeypatch.setattr(PartialRollouts, "__init__", refuse)
    cfg = _cfg(
        tmp_path,
        reward_path,
        algorithm__max_off_policy_steps=1,
        algorithm__partial_rollouts=False,
        train__steps=2,
    )
    train(cfg, out=lambda *a: None)
    rows = _steps(tmp_path / "run")
    assert len(rows) == 2
    assert not any(
        k.startswith("offpolicy/partial/") or "mixed" in k or "oldest" in k for r in rows for k in r
    )
    assert not list((tmp_path / "run" / "checkpoints").glob(f"*/{PARTIAL_FILE}"))


def test_partial_config_refusals(tmp_path, reward_path):
    with pytest.raises(ConfigError, match="must be >= 2 with algorithm.partial_rollouts"):
        _cfg(tmp_path, reward_path, algorithm__max_off_policy_steps=1).validate()
    with pytest.raises(ConfigError, match=r"\(>= 2 is for algorithm.partial_rollouts = true\)"):
        _cfg(tmp_path, reward_path, algorithm__partial_rollouts=False).validate()
    with pytest.raises(ConfigError, match="partial_oversample"):
        _cfg(tmp_path, reward_path, algorithm__partial_oversample=1.5).validate()
    with pytest.raises(ValueError, match="remax"):
        RLRun(_cfg(tmp_path, reward_path, algorithm__advantage="remax"), out=lambda *a: None)


def test_partial_generation_allocates_the_plans_cache(tmp_path, reward_path, monkeypatch):
    """On a GPU the loop gives the engine the memory plan's KV size (which counts the groups in flight) before its
    first generation; the partial path must too. Here the plan of a mocked 1 GiB device on the CPU run: the engine
    sized by itself would allocate its CPU default instead."""
    from exactrl.train.memory import GiB, plan_memory

    cfg = _cfg(tmp_path, reward_path, train__steps=1, train__save_every=0)
    cfg.validate()
    plan = plan_memory(cfg, gpu_memory=1 * GiB + (1 << 20), device="cuda")
    monkeypatch.setattr(loop_mod, "check_before_loading", lambda *a, **k: plan)
    run = RLRun(cfg, out=lambda *a, **k: None)
    try:
        run.run()
        assert run.engine.runner.num_blocks == plan.counts["kv_blocks"]
    finally:
        run.close()


def test_bench_rl_runs_partial_rollouts(tmp_path):
    """`exactrl bench rl --max-off-policy-steps 2 --partial-rollouts` at tiny scale: the generation is timed where
    it runs (the partial driver), exact, its cut and resume figures in the record beside the others'."""
    from exactrl.cli import main

    tiny = (
        "bench rl --preset tiny --device cpu --dtype float32 --prompts 4 --samples 2 --prompt-min 4 "
        "--prompt-max 8 --max-tokens 24 --completion-median 6 --steps 3 --max-num-seqs 16 "
        "--tokens-per-microbatch 64 --max-off-policy-steps 2 --partial-rollouts --partial-oversample 0.5"
    ).split()
    assert main([*tiny, "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("rl-tiny-offpolicy2-partial-exact-cpu.json")
    rec = json.loads(path.read_text())
    assert rec["partial_rollouts"] is True and rec["max_off_policy_steps"] == 2
    assert rec["mismatch_num_mismatched_tokens"] == 0 and rec["mismatch_num_tokens"] > 0
    assert rec["offpolicy_versions_behind_max"] <= 2
    assert sum(d["offpolicy_partial_resumed_samples"] for d in rec["steps_detail"]) > 0
    assert all(d["generate_s"] > 0 for d in rec["steps_detail"])  # timed in the partial driver


def test_a_resume_without_samples_in_flight_draws_fresh_request_ids(tmp_path, reward_path, monkeypatch):
    """A checkpoint without the pool (offpolicy_partial.json gone, or written by a run without partial rollouts):
    the resumed run starts a fresh pool whose request ids (they key the sampling noise) start past every id the
    earlier steps can have used, so no new prompt samples with an earlier prompt's noise."""
    cfg = _cfg(tmp_path, reward_path)
    monkeypatch.setattr(RLRun, "stop_requested", lambda self: self.step == 1)
    train(cfg, out=lambda *a: None)
    monkeypatch.undo()
    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    used = {g["request_id"] for g in json.loads((ckpt / PARTIAL_FILE).read_text())["pool"]}
    (ckpt / PARTIAL_FILE).unlink()
    notes: list[str] = []
    s = train(cfg, resume=True, out=lambda *a: notes.append(" ".join(map(str, a))))
    assert s["rl_steps"] == 4 and any("fresh pool" in n for n in notes)
    a = cfg.algorithm
    floor = 2 * (a.prompts_per_step + a.partial_extra_groups)  # (step 1 + 1) x the groups in flight
    later = json.loads((tmp_path / "run" / "checkpoints" / "step-000002" / PARTIAL_FILE).read_text())
    ids = {g["request_id"] for g in later["pool"]}
    assert ids and min(ids) >= floor > max(used)
