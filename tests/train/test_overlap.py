"""algorithm.overlap = "tail": groups trained on as they finish while the batch's tail generates, on-policy.

Runs are two steps of the tiny preset on CPU with a hashed reward (a random tiny model never gets an arithmetic
answer right) and many stop tokens, so completions end at different lengths and groups finish at different engine
steps. Faults are planted the way a real one shows: the engine records one logprob one ulp off.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from rl_runs import run_config, untimed
from rl_runs import steps as _steps
from rl_runs import weights as _weights

import exactrl.engine.engine as engine_mod
import exactrl.train.drivers.tail as tail_mod
import exactrl.train.overlap as overlap_mod
from exactrl.config import ConfigError
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model.loading import load_policy
from exactrl.train.loop import RLRun, train, trainer_settings
from exactrl.train.optim import MasterAdamW
from exactrl.train.overlap import MicrobatchFiller
from exactrl.train.packing import pack_by_tokens
from exactrl.train.stages import RunStages
from exactrl.train.trainer import MismatchError, PolicyTrainer, Rollout

REWARD = """
import hashlib

def hashed(completion, answer, example):
    return (int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5) / 4
"""
STOP_IDS = list(range(0, 512, 8))  # one token in eight ends a completion: lengths from 1 to max_tokens


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: the shared CPU runs these tiny runs faster so."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("reward")
    (d / "rw.py").write_text(REWARD)
    return d


def _cfg(tmp: Path, reward_dir: Path, overlap: str = "tail", out: str = "run", **over):
    d = {
        "run": {
            "name": "t",
            "seed": 0,
            "device": "cpu",
            "tensorboard": False,
            "report": False,
            "progress": False,
        },
        "model": {"preset": "tiny", "dtype": "float32"},
        "engine": {"block_size": 16, "max_model_len": 64},
        "sampling": {"temperature": 0.8, "max_tokens": 12, "stop_token_ids": STOP_IDS},
        "task": {
            "name": "arithmetic",
            "arithmetic_max_operand": 30,
            "use_chat_template": False,
            "num_eval": 2,
            "eval_every": 0,
            "max_prompt_tokens": 16,
        },
        "reward": {"functions": [f"{reward_dir / 'rw.py'}:hashed"]},
        "algorithm": {"name": "grpo", "group_size": 4, "rollouts_per_step": 16, "overlap": overlap},
        "train": {"steps": 2, "lr": 3e-4, "save_every": 1, "max_tokens_per_microbatch": 64},
        "sft": {"steps": 0},
    }
    return run_config(d, over, tmp / out)


# What depends on timing: wall-clock figures, and how much training was queued before generation ended (the
# composition of the microbatches does not depend on it).
_TIMED = ("perf/", "overlap/microbatches_during", "overlap/tokens_during", "overlap/share_during")


def _untimed(rows: list[dict]) -> list[dict]:
    return untimed(rows, _TIMED, any_time=False)


def _rollout_bits(rollouts) -> list[tuple]:
    return [
        (r.request_id, r.sample_index, r.prompt_ids, r.completion_ids, r.rollout_logprobs) for r in rollouts
    ]


def _same_rollouts(a, b) -> bool:
    """Token ids equal and recorded logprobs bitwise equal (torch.equal), rollout by rollout."""
    a, b = _rollout_bits(a), _rollout_bits(b)
    return len(a) == len(b) and all(x[:4] == y[:4] and torch.equal(x[4], y[4]) for x, y in zip(a, b))


def _unreachable(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} ran with algorithm.overlap = 'none'")

    return refuse


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reward_dir):
    """The default run (2 steps) and a 3-step tail run of the same config. In the tail run every step's engine is slowed a little
    (so the loop's thread surely gets groups while generation goes on) and every step first generates its batch
    synchronously from the same weights, for comparison."""
    tmp = tmp_path_factory.mktemp("runs")
    sync_rollouts: dict[int, object] = {}
    with pytest.MonkeyPatch.context() as mp:
        original_update = RunStages.update

        def keep_sync(self, step, rollouts, off_policy_cap=None):
            sync_rollouts[step] = list(rollouts)
            return original_update(self, step, rollouts, off_policy_cap)

        mp.setattr(RunStages, "update", keep_sync)
        # The off switch must be the code before overlap existed: every piece of the overlap machinery (the tail
        # driver, its group stream and microbatch filler, the trainer's fed step) is made unreachable, so the run
        # can only complete on the synchronous path (whole-batch `PolicyTrainer.step`).
        for cls, name in (
            (tail_mod.TailDriver, "__init__"),
            (overlap_mod.GroupStream, "__init__"),
            (overlap_mod.MicrobatchFiller, "__init__"),
            (PolicyTrainer, "begin_accumulation"),
            (PolicyTrainer, "accumulate"),
            (PolicyTrainer, "finish_accumulation"),
        ):
            mp.setattr(cls, name, _unreachable(f"{cls.__name__}.{name}"))
        sync_summary = train(_cfg(tmp, reward_dir, "none", out="sync"), out=lambda *a: None)

    reference: dict[int, list] = {}
    tail: dict[int, object] = {}
    with pytest.MonkeyPatch.context() as mp:
        original_step = tail_mod.TailDriver.sample_and_update
        original_engine_step = engine_mod._Generation.step

        def spy(self, step, examples, prompt_ids, index):
            outs = self.ctx.stages.rollout(step, prompt_ids, index)  # the synchronous generate, same weights
            reference[step] = [
                (o.request_id, [(s.token_ids, s.rollout_logprobs) for s in o.samples]) for o in outs
            ]
            result = original_step(self, step, examples, prompt_ids, index)
            tail[step] = result[0]
            return result

        def slow(self):
            time.sleep(0.01)  # the loop's thread runs while the engine thread sleeps (GIL released)
            return original_engine_step(self)

        # The tail's generate returns only after the loop's thread has queued a microbatch: which rollouts make a
        # microbatch depends on their order alone, so one always forms before the last group arrives, but whether
        # the loop's thread gets to it before the engine's last step is the scheduler's (a loaded machine's engine
        # thread can run the batch's tail out first). Without this wait the metric below is a race.
        fed = threading.Event()
        original_accumulate, original_generate = PolicyTrainer.accumulate, RolloutEngine.generate

        def accumulate(self, *a, **k):
            fed.set()
            return original_accumulate(self, *a, **k)

        def generate(self, *a, on_request_done=None, **k):
            if on_request_done is not None:  # the tail's stream (the spy's synchronous generate passes none)
                fed.clear()  # the previous step's last microbatch was fed after its generation ended
            out = original_generate(self, *a, on_request_done=on_request_done, **k)
            if on_request_done is not None:
                assert fed.wait(60), "no microbatch was queued while the engine generated"
            return out

        mp.setattr(tail_mod.TailDriver, "sample_and_update", spy)
        mp.setattr(engine_mod._Generation, "step", slow)
        mp.setattr(PolicyTrainer, "accumulate", accumulate)
        mp.setattr(RolloutEngine, "generate", generate)
        tail_cfg = _cfg(tmp, reward_dir, "tail", train__steps=3, train__keep_checkpoints=3)
        tail_summary = train(tail_cfg, out=lambda *a: None)
    return tmp, sync_summary, tail_summary, sync_rollouts, reference, tail


def test_off_is_the_code_before_overlap(runs):
    """overlap = "none" completed with every piece of the overlap machinery unreachable (the `runs` fixture plants
    an AssertionError in each): the off switch is the synchronous step, the code before this feature, on whatever
    machine runs it (no digest recorded on another CPU). No overlap metrics either; two updates were made."""
    tmp, sync_summary, *_ = runs
    rows = _steps(tmp / "sync")
    assert len(rows) == 2 and sync_summary["mismatched_tokens_total"] == 0
    assert all(r["optimizer_steps"] == 1 for r in rows)
    assert not any(k.startswith("overlap/") for r in rows for k in r)
    assert _weights(tmp / "sync", 2)


def test_tail_rollouts_are_the_synchronous_ones(runs):
    """Every step's rollouts are, bitwise, what a synchronous generate from the same weights gives; the first
    step's (same weights in both runs) are the default run's, with the same rewards and advantages."""
    tmp, _, _, sync_rollouts, reference, tail = runs
    assert sorted(reference) == sorted(tail) == [0, 1, 2]
    for step, sr in tail.items():
        got = {}
        for ro in sr.rollouts:
            got.setdefault(ro.request_id, []).append((ro.completion_ids, ro.rollout_logprobs))
        ref = {rid: samples for rid, samples in reference[step]}
        assert got.keys() == ref.keys()
        for rid, samples in ref.items():
            assert len(got[rid]) == len(samples)
            for (t1, l1), (t2, l2) in zip(got[rid], samples):
                assert t1 == t2 and torch.equal(l1, l2)
    first = tail[0]
    assert _same_rollouts(first.rollouts, sync_rollouts[0])
    assert [r.reward for r in first.rollouts] == [r.reward for r in sync_rollouts[0]]
    assert [r.advantage for r in first.rollouts] == [r.advantage for r in sync_rollouts[0]]
    # Lengths really vary (the stop tokens), so groups finish at different engine steps.
    assert len({len(r.completion_ids) for r in first.rollouts}) > 3
    # Negative control of the comparison: the second step sampled from other weights than the first.
    assert not _same_rollouts(tail[1].rollouts, tail[0].rollouts)


def test_tail_is_exact_and_trains_during_generation(runs):
    tmp, _, tail_summary, *_ = runs
    rows = _steps(tmp / "run")
    assert len(rows) == 3 and tail_summary["mismatched_tokens_total"] == 0
    for r in rows:
        # Every model token checked inside the training forward, none differs, one update.
        assert r["mismatch/num_tokens"] == r["mismatch/completion_tokens"] > 0
        assert r["mismatch/num_mismatched_tokens"] == 0 and r["optimizer_steps"] == 1
        assert r["ratio/min"] == r["ratio/max"] == 1.0  # on-policy: the trainer's weights sampled every token
        assert r["overlap/microbatches"] > 1
        # Some of the training was queued while the engine still generated.
        assert r["overlap/microbatches_during_generation"] >= 1
        assert 0 < r["overlap/tokens_during_generation"] <= r["mismatch/completion_tokens"]
        for key in ("perf/generate_s", "perf/train_s", "perf/wait_s", "perf/train_after_generate_s"):
            assert r[key] >= 0


def test_tail_same_seed_same_run_close_to_but_not_the_synchronous_one(runs, tmp_path, reward_dir):
    tmp, *_ = runs
    train(_cfg(tmp_path, reward_dir, "tail", train__steps=3), out=lambda *a: None)
    assert _untimed(_steps(tmp / "run")) == _untimed(_steps(tmp_path / "run"))
    a, b = _weights(tmp / "run", 3), _weights(tmp_path / "run", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The first update agrees with the synchronous one to float rounding, not bitwise (other microbatches, the
    # divisor applied once): the run is not the synchronous run, as documented. AdamW's first step moves a weight
    # by about lr * sign(gradient), so a weight whose gradient is near 0 may move differently by a fraction of lr.
    s1, t1 = _weights(tmp / "sync", 1), _weights(tmp / "run", 1)
    assert all(torch.allclose(s1[k], t1[k], rtol=0, atol=0.1 * 3e-4) for k in s1)
    assert any(not torch.equal(s1[k], t1[k]) for k in s1)
    sync_rows, tail_rows = _steps(tmp / "sync"), _steps(tmp / "run")
    assert tail_rows[0]["loss"] == pytest.approx(sync_rows[0]["loss"], rel=1e-5, abs=1e-7)
    assert tail_rows[0]["grad_norm"] == pytest.approx(sync_rows[0]["grad_norm"], rel=1e-5)


# -- the guard -------------------------------------------------------------------------------------------------


@pytest.fixture
def fault_in_call(monkeypatch):
    """`fault_in_call(k)`: in the k-th generate call (1-based), the first sample the engine builds records its first
    logprob one ulp off (the streamed and the returned outputs share that Sample)."""

    def arm(k: int) -> None:
        calls = {"n": 0}
        original_start = RolloutEngine._start
        original_sample = engine_mod._Generation.sample_of

        def start(self, *a, **kw):
            calls["n"] += 1
            call = original_start(self, *a, **kw)
            call.plant = calls["n"] == k
            return call

        def sample_of(self, seq):
            smp = original_sample(self, seq)
            if getattr(self, "plant", False):
                self.plant = False
                smp.rollout_logprobs[0] = torch.nextafter(smp.rollout_logprobs[0], torch.tensor(0.0))
            return smp

        monkeypatch.setattr(RolloutEngine, "_start", start)
        monkeypatch.setattr(engine_mod._Generation, "sample_of", sample_of)

    return arm


def test_fault_aborts_before_the_update(tmp_path, reward_dir, fault_in_call, monkeypatch):
    # Generate calls: 1 = the held-out evaluation before RL, 2 = step 1, 3 = step 2.
    fault_in_call(3)
    seen = {}
    original = RunStages.mismatch_abort

    def spy(self, step, sr, err):
        seen["weights"] = {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()}
        original(self, step, sr, err)

    monkeypatch.setattr(RunStages, "mismatch_abort", spy)
    with pytest.raises(MismatchError) as err:
        train(_cfg(tmp_path, reward_dir), out=lambda *a: None)
    msg = str(err.value)
    assert "no optimizer step was applied" in msg and "1 of" in msg and "0x" in msg
    run = tmp_path / "run"
    saved = _weights(run, 1)
    held = {k: v for k, v in seen["weights"].items() if k in saved}
    assert held and all(torch.equal(saved[k], v) for k, v in held.items())  # nothing of step 2 applied
    report = json.loads((run / "mismatch-000002" / "report.json").read_text())
    assert report["step"] == 2 and len(report["sequences"]) == 1


def test_fault_skip_step_drops_the_batch(tmp_path, reward_dir, fault_in_call):
    fault_in_call(2)  # step 1
    s = train(_cfg(tmp_path, reward_dir, run__on_mismatch="skip_step"), out=lambda *a: None)
    rows = _steps(tmp_path / "run")
    assert rows[0]["mismatch/step_skipped"] == 1 and rows[0]["optimizer_steps"] == 0
    assert rows[0]["mismatch/num_mismatched_tokens"] == 1 and rows[1]["optimizer_steps"] == 1
    assert s["mismatch_skipped_steps_total"] == 1
    assert (tmp_path / "run" / "mismatch-000001" / "report.json").is_file()


def test_weights_changed_mid_generation_are_caught(tmp_path, reward_dir, monkeypatch):
    """Negative control of the on-policy claim: if something wrote the weights while the tail generated (what the
    optimizer step must never do before the batch ends), the tokens sampled before and after would be from
    different weights, and the guard catches it before any update."""
    original = overlap_mod.GroupStream.__iter__

    def poke(self):
        for k, out in enumerate(original(self)):
            if k == 1:  # after the first group: one weight moves, while the rest still generates
                with torch.no_grad():
                    poke.model.model.norm.weight.add_(1e-3)
            yield out

    monkeypatch.setattr(overlap_mod.GroupStream, "__iter__", poke)
    run = RLRun(_cfg(tmp_path, reward_dir, train__steps=1), out=lambda *a: None)
    poke.model = run.model
    try:
        with pytest.raises(MismatchError, match="no optimizer step was applied"):
            run.run()
    finally:
        run.close()


# -- the trainer's fed step against the whole-batch step -------------------------------------------------------


def _rollouts(model, tok, n_prompts: int = 4, group: int = 4) -> list[Rollout]:
    engine = RolloutEngine(model, EngineConfig(block_size=16, max_model_len=64), tokenizer=tok)
    prompts = [tok.encode(f"{i} + {2 * i} =") for i in range(n_prompts)]
    params = SamplingParams(temperature=0.8, max_tokens=12, n=group, seed=3, stop_token_ids=STOP_IDS)
    outs = engine.generate(prompts, params)
    g = torch.Generator().manual_seed(0)
    out = []
    for o in outs:
        for j, s in enumerate(o.samples):
            adv = float(torch.randn((), generator=g))
            out.append(
                Rollout(o.prompt_token_ids, s.token_ids, s.rollout_logprobs, advantage=adv, sample_index=j)
            )
    return out


def _power_of_two_tokens(rollouts: list[Rollout]) -> list[Rollout]:
    """The rollouts with completions cut (longest first, a token at a time) until they hold 2^k tokens in all: a
    completion's prefix with its logprobs is still what the engine sampled, and a power-of-two divisor makes
    dividing before the backward (the whole step) and after the sum (the fed step) the same exact scaling."""
    cut = [list(r.completion_ids) for r in rollouts]
    target = 1 << (sum(map(len, cut)).bit_length() - 1)
    while sum(map(len, cut)) > target:
        i = max(range(len(cut)), key=lambda j: len(cut[j]))
        cut[i].pop()
    return [
        dataclasses.replace(r, completion_ids=c, rollout_logprobs=r.rollout_logprobs[: len(c)].clone())
        for r, c in zip(rollouts, cut)
    ]


def _whole_and_fed(cfg, pieces, trim: bool = False):
    """The optimizer's gradients and the metrics of one `step` over the rollouts and of the same rollouts fed as
    `pieces(rollouts)`, each from a fresh model."""
    grads, metrics = {}, {}
    for how in ("whole", "fed"):
        torch.manual_seed(0)
        model, tok = load_policy(preset_name="tiny", device="cpu", dtype="float32", exact=True, seed=0)
        rollouts = _rollouts(model, tok)
        if trim:
            rollouts = _power_of_two_tokens(rollouts)
        ref = load_policy(preset_name="tiny", device="cpu", dtype="float32", exact=True, seed=0)[0]
        opt = MasterAdamW(model, lr=1e-3)
        trainer = PolicyTrainer(model, trainer_settings(cfg), opt, ref_model=ref.requires_grad_(False))
        original = opt.clip_and_step_async

        def spy(max_norm, skip=None, _how=how, _trainer=trainer, _orig=original):
            grads[_how] = [g.clone() for g in _trainer._grads]
            return _orig(max_norm, skip)

        opt.clip_and_step_async = spy
        if how == "whole":
            metrics[how] = trainer.step(rollouts)
        else:
            acc = trainer.begin_accumulation()
            for piece in pieces(rollouts):
                trainer.accumulate(acc, piece)
            metrics[how] = trainer.finish_accumulation(acc)
    assert len(grads["whole"]) == len(grads["fed"]) > 0
    assert any(a.abs().max() > 0 for a in grads["whole"])
    return grads, metrics


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_fed_step_is_the_whole_step_up_to_rounding(tmp_path, reward_dir, aggregation):
    """Where the two steps' arithmetic differs only by where the exact divisor enters: the same rollouts fed as one
    piece in the same order (so the same microbatches), and a power-of-two divisor (2^k loss tokens for token-mean,
    16 sequences for the seq-mean modes), the fed step's gradient is the whole step's, bit for bit. So the fed step
    adds no term and drops none: what differs otherwise is rounding (next test)."""
    cfg = _cfg(tmp_path, reward_dir, "none", algorithm__aggregation=aggregation, algorithm__kl_coef=0.1)
    cfg.algorithm.entropy_coef = 0.01
    grads, metrics = _whole_and_fed(cfg, lambda rs: [rs], trim=True)
    assert all(torch.equal(a, b) for a, b in zip(grads["whole"], grads["fed"]))
    assert metrics["fed"]["pg_loss"] == metrics["whole"]["pg_loss"]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_fed_step_equals_the_whole_batch_step(tmp_path, reward_dir, aggregation):
    """Same rollouts, fed in pieces (another order, other microbatches) vs one `step`, with KL to the reference and
    an entropy bonus on: the gradients differ by summation order and the divisor's place only (the test above
    shows there is nothing else), so each parameter's gradient agrees within a rounding bound scaled to that
    gradient's magnitude, 2^-13 of its largest element (a few hundred fp32 ulps on any CPU; a wrong divisor or a
    lost rollout moves it by more than 1/300)."""
    cfg = _cfg(tmp_path, reward_dir, "none", algorithm__aggregation=aggregation, algorithm__kl_coef=0.1)
    cfg.algorithm.entropy_coef = 0.01
    grads, metrics = _whole_and_fed(cfg, lambda rs: ((o := rs[8:] + rs[:8])[:3], o[3:10], o[10:]))
    for a, b in zip(grads["whole"], grads["fed"]):
        bound = 2**-13 * float(a.abs().max())
        assert float((a - b).abs().max()) <= bound, (tuple(a.shape), float((a - b).abs().max()), bound)
    # `loss` is a token-weighted mean of each microbatch's own aggregate: for the seq-mean modes that depends on
    # how sequences were grouped (in the synchronous step as well); pg_loss is the step's objective.
    keys = ["pg_loss", "grad_norm", "kl_ref", "entropy", "num_tokens"] + (
        ["loss"] if aggregation == "token-mean" else []
    )
    for key in keys:
        assert metrics["fed"][key] == pytest.approx(metrics["whole"][key], rel=2**-13, abs=1e-8), key
    assert metrics["fed"]["mismatch/num_mismatched_tokens"] == 0
    assert metrics["fed"]["mismatch/num_tokens"] == metrics["whole"]["mismatch/num_tokens"]


def test_microbatch_filler_cuts_as_pack_by_tokens():
    """The online cut depends on the order alone and equals `pack_by_tokens` over the same list."""
    lens = [5, 9, 3, 30, 2, 2, 7, 40, 1, 11]
    rollouts = [Rollout([1, 2], [3] * (n - 1), torch.zeros(n - 1)) for n in lens]
    for budget in (8, 16, 40):
        filler = MicrobatchFiller(budget)
        got = []
        for k in range(0, len(rollouts), 3):  # arriving in pieces
            got += filler.add(rollouts[k : k + 3])
        got += filler.flush()
        want = pack_by_tokens(lens, budget)
        where = {id(r): i for i, r in enumerate(rollouts)}
        assert [[where[id(r)] for r in mb] for mb in got] == want


# -- the engine's hook ----------------------------------------------------------------------------------------


def test_engine_reports_each_request_once_as_it_finishes():
    model, tok = load_policy(preset_name="tiny", device="cpu", dtype="float32", exact=True, seed=0)
    engine = RolloutEngine(model, EngineConfig(block_size=16, max_model_len=64), tokenizer=tok)
    prompts = [tok.encode(f"{i} * {i} =") for i in range(6)] + [[1] * 80]  # the last is too long: refused
    params = SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=1, stop_token_ids=STOP_IDS)
    plain = engine.generate(prompts, params)
    seen: list = []
    outs = engine.generate(prompts, params, on_request_done=seen.append)
    # Bitwise the call without the hook.
    for a, b in zip(plain, outs):
        assert a.error == b.error and len(a.samples) == len(b.samples)
        assert all(
            x.token_ids == y.token_ids and torch.equal(x.rollout_logprobs, y.rollout_logprobs)
            for x, y in zip(a.samples, b.samples)
        )
    # Each request once, the refused one first; the reported samples are the returned ones.
    assert sorted(o.request_id for o in seen) == list(range(7))
    assert seen[0].request_id == 6 and seen[0].error is not None
    by_id = {o.request_id: o for o in outs}
    for o in seen[1:]:
        assert o.error is None and len(o.samples) == 3
        assert all(x is y for x, y in zip(o.samples, by_id[o.request_id].samples))
    # In finish order: every prompt is prefilled in the first step and a sample grows one token a step, so a
    # request completes at the step of its longest sample; the reports come in that order (and not in id order).
    longest = [max(len(s.token_ids) for s in o.samples) for o in seen[1:]]
    assert longest == sorted(longest) and len(set(longest)) > 1
    assert [o.request_id for o in seen[1:]] != sorted(o.request_id for o in seen[1:])


# -- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "key"),
    [
        ({"run__exact": False}, "run.exact"),
        ({"algorithm__ppo_epochs": 2}, "algorithm.ppo_epochs"),
        ({"algorithm__minibatches_per_rollout": 2}, "algorithm.ppo_epochs"),
        ({"algorithm__name": "ppo"}, "algorithm.advantage"),
        ({"algorithm__advantage": "reinforce_plus_plus"}, "algorithm.advantage"),
        ({"algorithm__advantage": "remax"}, "algorithm.advantage"),
        ({"algorithm__advantage": "gpg"}, "algorithm.advantage"),
        ({"algorithm__adv_scale": "batch"}, "algorithm.adv_scale"),
        ({"algorithm__whiten_advantages": True}, "algorithm.whiten_advantages"),
        ({"algorithm__max_off_policy_steps": 1}, "algorithm.max_off_policy_steps"),
        ({"run__exact": True, "algorithm__rollout_correction": "token-tis"}, "algorithm.rollout_correction"),
    ],
)
def test_options_that_need_the_whole_batch_are_refused_by_name(tmp_path, reward_dir, over, key):
    _cfg(tmp_path, reward_dir).validate()  # the tail config itself is valid
    cfg = _cfg(tmp_path, reward_dir, **over)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert err.value.key == key and "overlap" in str(err.value)


def test_off_never_builds_the_stage(tmp_path, reward_dir, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the tail overlap ran with algorithm.overlap = 'none'")

    monkeypatch.setattr(tail_mod.TailDriver, "__init__", refuse)
    monkeypatch.setattr(PolicyTrainer, "begin_accumulation", refuse)
    run = RLRun(_cfg(tmp_path, reward_dir, "none", train__steps=1), out=lambda *a: None)
    try:
        assert run.driver_name == "sync"
        run.run()
    finally:
        run.close()


def test_bench_rl_runs_the_tail_overlap(tmp_path):
    """`exactrl bench rl --overlap tail` at tiny scale: exact, its record beside (not over) the synchronous one's,
    with the overlap's own breakdown."""
    from exactrl.cli import main

    tiny = (
        "bench rl --preset tiny --device cpu --dtype float32 --prompts 3 --samples 2 --prompt-min 4 "
        "--prompt-max 8 --max-tokens 12 --completion-median 6 --steps 1 --warmup 0 --max-num-seqs 8 "
        "--tokens-per-microbatch 24 --overlap tail"
    ).split()
    assert main([*tiny, "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("rl-tiny-overlap-tail-exact-cpu.json")
    rec = json.loads(path.read_text())
    assert rec["overlap"] == "tail" and rec["max_off_policy_steps"] == 0
    assert (
        rec["mismatch_num_mismatched_tokens"] == 0 and rec["mismatch_num_tokens"] == rec["generated_tokens"]
    )
    assert rec["generate_s"] > 0 and rec["train_s"] > 0 and rec["reward_s"] > 0
    assert rec["overlap_microbatches"] >= 2 and 0 <= rec["overlap_share_during_generation"] <= 1
    assert rec["train_after_generate_s"] >= 0 and rec["trace"]
