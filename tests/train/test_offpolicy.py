"""One-step-off RL (algorithm.max_off_policy_steps = 1): exact behaviour logprobs, the guard on stale batches,
decoupled PPO, and k = 0 left on today's path.

Runs are a few steps of the tiny preset on CPU with a hashed reward (a random tiny model never gets an arithmetic
answer right; all-zero rewards would train nothing, and a batch one version behind would then be no different
from a fresh one). A fault is planted the way a real one shows: the engine records one logprob one ulp off.
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

import exactrl.engine.engine as engine_mod
import exactrl.train.drivers.offpolicy as offpolicy_driver
import exactrl.train.loop as loop_mod
from exactrl.algorithms import decoupled_is_weights, policy_loss_terms
from exactrl.config import ConfigError
from exactrl.train.loop import RLRun, train
from exactrl.train.trainer import MismatchError

REWARD = """
import hashlib

def hashed(completion, answer, example):
    return (int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5) / 4
"""


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: the shared CPU runs these tiny runs much faster so (same count in every comparison)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", autouse=True)
def _reward_file(tmp_path_factory):
    """One reward file for every run: its path names the reward's metrics, which runs compare."""
    global _REWARD_PATH
    _REWARD_PATH = tmp_path_factory.mktemp("reward") / "rw.py"
    _REWARD_PATH.write_text(REWARD)


_REWARD_PATH: Path | None = None


def _cfg(tmp_path: Path, k: int = 1, out: str = "run", **over):
    d = {
        "run": {
            "name": "o",
            "seed": 0,
            "device": "cpu",
            "tensorboard": False,
            "report": False,
            "progress": False,
        },
        "model": {"preset": "tiny", "dtype": "float32"},
        "engine": {"block_size": 16, "max_model_len": 64},
        "sampling": {"temperature": 0.8, "max_tokens": 4},
        "task": {
            "name": "arithmetic",
            "arithmetic_max_operand": 30,
            "use_chat_template": False,
            "num_eval": 4,
            "eval_every": 0,
            "max_prompt_tokens": 16,
        },
        "reward": {"functions": [f"{_REWARD_PATH}:hashed"]},
        "algorithm": {"name": "grpo", "group_size": 4, "rollouts_per_step": 16, "max_off_policy_steps": k},
        "train": {"steps": 3, "lr": 3e-4, "save_every": 1},
        "sft": {"steps": 0},
    }
    return run_config(d, over, tmp_path / out)


@pytest.fixture
def fault_at_call(monkeypatch):
    """`fault_at_call(k)`: the k-th generate call (1-based) records its first sample's first logprob one ulp off."""

    def arm(k: int) -> None:
        calls = {"n": 0}
        original = engine_mod._Generation.collect

        def collect(self, outputs):
            original(self, outputs)
            calls["n"] += 1
            if calls["n"] == k:
                lp = next(s for o in outputs for s in o.samples).rollout_logprobs
                lp[0] = torch.nextafter(lp[0], torch.tensor(0.0))

        monkeypatch.setattr(engine_mod._Generation, "collect", collect)

    return arm


# -- the loss half: decoupled PPO against a float64 reference ----------------------------------------------------


def _reference_decoupled(lp, prox, behav, adv, mask, eps_low, eps_high, cap) -> torch.Tensor:
    """Decoupled PPO's token-mean loss written out token by token in float64: -w min(r A, clip(r) A),
    r = pi / pi_prox, w = min(pi_prox / pi_behav, cap)."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            r = torch.exp(lp[i, t] - prox[i, t])
            w = min(float(torch.exp(prox[i, t] - behav[i, t])), cap)
            a = float(adv[i])
            total = total - w * torch.minimum(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a)
            count += 1
    return total / count


def _loss_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 7
    behav = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    prox = behav + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4  # the policy one version later
    lp = prox + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 5, 1])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return lp, prox, behav, adv, mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decoupled_ppo_matches_the_float64_reference(dtype):
    lp64, prox, behav, adv, mask = _loss_inputs()
    cap = 1.5  # low enough that some tokens hit it (checked below)
    w, wm = decoupled_is_weights(prox.to(dtype), behav.to(dtype), mask, cap)
    assert 0 < wm["offpolicy/is_weight/capped_frac"] < 1  # both branches of the cap are exercised
    lp = lp64.to(dtype).detach().clone().requires_grad_(True)
    loss, _ = policy_loss_terms(
        lp, prox.to(dtype), adv.to(dtype), mask, kind="ppo_clip", eps_low=0.2, eps_high=0.2, is_weights=w
    )
    loss.backward()
    ref_lp = lp64.detach().clone().requires_grad_(True)
    ref = _reference_decoupled(ref_lp, prox, behav, adv, mask, 0.2, 0.2, cap)
    ref.backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert abs(loss.item() - ref.item()) <= tol * max(1.0, abs(ref.item()))
    assert torch.allclose(lp.grad.double(), ref_lp.grad, atol=tol, rtol=tol)
    # Negative control: the plain PPO ratio against the behaviour policy (no proximal policy) is another loss.
    plain, _ = policy_loss_terms(lp64, behav, adv, mask, kind="ppo_clip", eps_low=0.2, eps_high=0.2)
    assert abs(plain.item() - ref.item()) > 1e-3


def test_decoupled_weights_are_exactly_one_on_policy_and_zero_on_padding():
    _, prox, _, _, mask = _loss_inputs()
    w, wm = decoupled_is_weights(prox.float(), prox.float(), mask, 2.0)
    assert torch.equal(w, mask.float())  # pi_prox == pi_behav bitwise: weight 1 exactly, 0 on padding
    assert wm["offpolicy/is_weight/mean"] == 1.0 and wm["offpolicy/is_weight/capped_frac"] == 0.0
    with pytest.raises(ValueError, match="cap must be"):
        decoupled_is_weights(prox, prox, mask, 0.5)


# -- the loop --------------------------------------------------------------------------------------------------


def test_k0_takes_todays_path(tmp_path, monkeypatch):
    """max_off_policy_steps = 0: no weight copy, no worker, no off-policy stage; the engine samples the policy.
    (The metrics of such a run were compared bit for bit with the code before this feature: the same.)"""

    def refuse(*a, **k):
        raise AssertionError("the off-policy machinery ran at max_off_policy_steps = 0")

    for name in ("BehaviourPolicy", "ReplicaBehaviour"):
        monkeypatch.setattr(loop_mod, name, refuse)
    for name in ("GenerationWorker", "check_batch", "step_staleness"):
        monkeypatch.setattr(offpolicy_driver, name, refuse)
    monkeypatch.setattr(offpolicy_driver.OneStepOffDriver, "__init__", refuse)
    cfg = _cfg(tmp_path, k=0, train__steps=2)
    run = RLRun(cfg, out=lambda *a: None)
    try:
        s = run.run()
        assert run.engine.model is run.model and run.behaviour is None
    finally:
        run.close()
    rows = _steps(tmp_path / "run")
    assert s["mismatched_tokens_total"] == 0 and len(rows) == 2
    assert not any(k.startswith("offpolicy/") for r in rows for k in r)


@pytest.fixture(scope="module")
def k1_run(tmp_path_factory):
    """A 3-step run at k = 1 (shared by the tests that only read it)."""
    tmp = tmp_path_factory.mktemp("k1")
    copies: dict[int, dict[str, torch.Tensor]] = {}
    original = offpolicy_driver.OneStepOffDriver.batch

    def spy(
        self, step
    ):  # the engine's copy as generation of `step`'s batch starts (in the worker but the first)
        copies[step] = {k: v.detach().clone() for k, v in self.behaviour.model.state_dict().items()}
        # The engine samples from the copy, never from the policy the trainer is updating in place meanwhile.
        copies[step]["engine is the copy"] = (
            self.ctx.engine.model is self.behaviour.model is not self.ctx.trainer.model
        )
        return original(self, step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offpolicy_driver.OneStepOffDriver, "batch", spy)
        s = train(_cfg(tmp, train__keep_checkpoints=3), out=lambda *a: None)
    return tmp, s, copies


def test_k1_is_exact_and_one_version_behind(k1_run):
    tmp, s, copies = k1_run
    rows = _steps(tmp / "run")
    assert len(rows) == 3 and s["mismatched_tokens_total"] == 0
    for r in rows:
        # Every model token of every step checked against the behaviour weights, none differs.
        assert r["mismatch/num_tokens"] == r["mismatch/completion_tokens"] > 0
        assert r["mismatch/num_mismatched_tokens"] == 0 and r["optimizer_steps"] == 1
    assert [r["offpolicy/versions_behind/token_mean"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["offpolicy/versions_behind/seq_mean"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["offpolicy/behaviour_version"] for r in rows] == [0.0, 0.0, 1.0]
    # The first batch is on-policy: weight 1 exactly. Later ones are really stale: the current policy's logprobs
    # differ from the behaviour ones (a guard run at the current weights would have failed on them).
    assert rows[0]["offpolicy/is_weight/mean"] == 1.0 and rows[0]["offpolicy/is_weight/max"] == 1.0
    assert all(r["offpolicy/is_weight/max"] != 1.0 for r in rows[1:])
    # The ratio is taken against the current policy (decoupled PPO): with one update per step it is 1 exactly on
    # every token, however stale the batch (a ratio against the behaviour logprobs would not be).
    assert all(r["ratio/min"] == r["ratio/max"] == 1.0 for r in rows)
    # The engine's copy held the version the batch is tagged with, bit for bit: batches 0 and 1 (0-based) were
    # sampled by version 0 (the initial weights), batch 2 by version 1 (the checkpoint of step 1).
    assert sorted(copies) == [0, 1, 2]
    assert all(c.pop("engine is the copy") for c in copies.values())
    assert all(torch.equal(copies[0][k], v) for k, v in copies[1].items())
    saved = _weights(tmp / "run", 1)
    held = {k: v for k, v in copies[2].items() if k in saved}
    assert held and all(torch.equal(saved[k], v) for k, v in held.items())
    first = _weights(tmp / "run", 1)
    assert any(not torch.equal(first[k], v) for k, v in copies[0].items() if k in first)  # the policy moved


def test_k1_same_seed_same_run_and_not_the_synchronous_one(k1_run, tmp_path):
    tmp, _, _ = k1_run
    train(_cfg(tmp_path, train__keep_checkpoints=3), out=lambda *a: None)
    assert _untimed(_steps(tmp / "run")) == _untimed(_steps(tmp_path / "run"))
    a, b = _weights(tmp / "run", 3), _weights(tmp_path / "run", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Negative control: the synchronous run trains on fresher batches and ends elsewhere.
    train(_cfg(tmp_path, k=0, out="sync"), out=lambda *a: None)
    c = _weights(tmp_path / "sync", 3)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_k1_fault_aborts_before_the_update_and_resumes(tmp_path, fault_at_call, monkeypatch):
    # Generate calls: 1 = the held-out evaluation, 2 = step 1's batch, 3 = step 2's batch, sampled by the worker
    # during step 1's update and checked then; step 2 must refuse it before its update.
    fault_at_call(3)
    cfg = _cfg(tmp_path)
    seen = {}
    original = offpolicy_driver.OneStepOffDriver.refuse

    def spy(self, step, batch):
        seen["weights"] = {k: v.detach().clone() for k, v in self.ctx.trainer.model.state_dict().items()}
        return original(self, step, batch)

    monkeypatch.setattr(offpolicy_driver.OneStepOffDriver, "refuse", spy)
    lines: list[str] = []
    with pytest.raises(MismatchError) as err:
        train(cfg, out=lambda *a: lines.append(" ".join(map(str, a))))
    msg = str(err.value)
    assert "step 2" in msg and "no optimizer step was applied" in msg and "behaviour weights" in msg
    assert "completion position 0" in msg and "0x" in msg
    run = tmp_path / "run"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000001"
    saved = _weights(run, 1)
    named = {k: v for k, v in seen["weights"].items() if k in saved}
    assert named and all(torch.equal(saved[k], v) for k, v in named.items())  # nothing of step 2 applied
    report = json.loads((run / "mismatch-000002" / "report.json").read_text())
    assert report["step"] == 2 and report["sequences"]
    # The resume samples step 2's batch again from the checkpoint's weights, says so, and finishes exact.
    monkeypatch.undo()
    lines.clear()
    s = train(cfg, resume=True, out=lambda *a: lines.append(" ".join(map(str, a))))
    assert s["rl_steps"] == 3 and s["mismatched_tokens_total"] == 0
    assert any("sampled again from the checkpoint's weights" in x for x in lines)
    rows = {r["step"]: r for r in _steps(run)}
    assert rows[2]["offpolicy/versions_behind/token_mean"] == 0.0
    assert rows[3]["offpolicy/versions_behind/token_mean"] == 1.0


def test_k1_skip_step_drops_the_stale_batch(tmp_path, fault_at_call):
    fault_at_call(3)
    s = train(_cfg(tmp_path, run__on_mismatch="skip_step", train__keep_checkpoints=3), out=lambda *a: None)
    rows = {r["step"]: r for r in _steps(tmp_path / "run")}
    assert rows[2]["mismatch/step_skipped"] == 1 and rows[2]["optimizer_steps"] == 0
    assert rows[2]["mismatch/num_mismatched_tokens"] == 1
    assert rows[1]["optimizer_steps"] == 1 and rows[3]["optimizer_steps"] == 1
    assert s["mismatch_skipped_steps_total"] == 1 and s["mismatched_tokens_total"] == 1
    assert torch.equal(
        _weights(tmp_path / "run", 1)["model.embed_tokens.weight"],
        _weights(tmp_path / "run", 2)["model.embed_tokens.weight"],
    )


def test_k1_refused_where_it_is_not_exact(tmp_path):
    with pytest.raises(ValueError, match="run.exact"):
        RLRun(_cfg(tmp_path, run__exact=False), out=lambda *a: None)
    with pytest.raises(ConfigError, match="max_off_policy_steps"):
        _cfg(tmp_path, k=2).validate()


def test_bench_rl_runs_one_step_off(tmp_path, capsys):
    """`exactrl bench rl --max-off-policy-steps 1` at tiny scale: the off-policy loop's step, exact, one version
    behind after the warm-up step, its record beside (not over) the synchronous one's."""
    from exactrl.cli import main

    tiny = (
        "bench rl --preset tiny --device cpu --dtype float32 --prompts 2 --samples 2 --prompt-min 4 "
        "--prompt-max 8 --max-tokens 12 --completion-median 6 --steps 2 --max-num-seqs 8 "
        "--tokens-per-microbatch 64 --max-off-policy-steps 1"
    ).split()
    assert main([*tiny, "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("rl-tiny-offpolicy1-exact-cpu.json")
    rec = json.loads(path.read_text())
    assert rec["overlapped"] is True and rec["max_off_policy_steps"] == 1
    assert rec["offpolicy_versions_behind"] == 1.0
    assert (
        rec["mismatch_num_mismatched_tokens"] == 0 and rec["mismatch_num_tokens"] == rec["generated_tokens"]
    )
    assert rec["train_s"] > 0 and rec["offpolicy_wait_s"] >= 0 and rec["offpolicy_guard_s"] > 0
    # Every timed step samples the next batch in the worker (the last one too: steady state).
    assert all(d["generate_s"] > 0 and d["reward_s"] > 0 for d in rec["steps_detail"])


def test_k1_resume_is_bitwise(k1_run, tmp_path, monkeypatch):
    """A run stopped after step 2 (as by a signal) and resumed trains step 3 on the batch its checkpoint holds
    (sampled ahead by version 1, checked then): metrics and weights bitwise the uninterrupted run's."""
    tmp, _, _ = k1_run
    cfg = _cfg(tmp_path, train__keep_checkpoints=3)
    monkeypatch.setattr(RLRun, "stop_requested", lambda self: self.step == 2)
    s = train(cfg, out=lambda *a: None)
    assert s["rl_steps"] == 2 and s["stopped_early"]
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "offpolicy_pending.json").is_file()
    monkeypatch.undo()
    lines: list[str] = []
    s = train(cfg, resume=True, out=lambda *a: lines.append(" ".join(map(str, a))))
    assert s["rl_steps"] == 3 and s["mismatched_tokens_total"] == 0
    assert any("trains on the batch the checkpoint holds (sampled by version 1)" in x for x in lines)
    assert _untimed(_steps(tmp_path / "run")) == _untimed(_steps(tmp / "run"))
    a, b = _weights(tmp / "run", 3), _weights(tmp_path / "run", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_proximal_from_the_training_forward_equals_a_scoring_pass(k1_run, tmp_path, monkeypatch):
    """With one update per step the proximal logprobs come from the training forward itself; a separate no-grad
    scoring forward gives the same bits, so the two runs are the same run (weights and metrics)."""
    from exactrl.train.trainer import PolicyTrainer

    tmp, _, _ = k1_run
    monkeypatch.setattr(PolicyTrainer, "fuse_proximal", False)
    train(_cfg(tmp_path, train__keep_checkpoints=3), out=lambda *a: None)
    fused, scored = _untimed(_steps(tmp / "run")), _untimed(_steps(tmp_path / "run"))
    # The weights' mean and capped share are summed per microbatch in one case and averaged in one call in the
    # other: equal to rounding; everything else bit for bit.
    summed = ("offpolicy/is_weight/mean", "offpolicy/is_weight/capped_frac")
    for f, c in zip(fused, scored, strict=True):
        assert {k: v for k, v in f.items() if k not in summed} == {
            k: v for k, v in c.items() if k not in summed
        }
        assert all(f[k] == pytest.approx(c[k], rel=1e-6) for k in summed)
    a, b = _weights(tmp / "run", 3), _weights(tmp_path / "run", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.extended  # make test-all; by default tests/train/test_dynamic_sampling.py runs multi-turn one step off
def test_k1_multi_turn_is_exact_one_version_behind_and_resumes_bitwise(tmp_path, monkeypatch):
    """Multi-turn episodes one step off (tests/envs/sample_envs.py's VaryingReward: two model turns around an
    observation, a reward that varies within a group): the worker runs the next batch's episodes against the
    environment while the trainer updates; the guard checks every model token of every turn against the behaviour
    weights (observations masked), none differs; a run stopped after step 2 and resumed (its checkpoint holds the
    pending episodes, loss masks included) is bitwise the uninterrupted one. Control: the synchronous run ends
    elsewhere."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "envs"))
    mt = dict(
        env__name="sample_envs:VaryingReward",
        env__isolation="thread",
        env__max_turns=2,
        env__max_episode_tokens=32,
        train__keep_checkpoints=3,
    )
    s = train(_cfg(tmp_path, out="full", **mt), out=lambda *a: None)
    rows = _steps(tmp_path / "full")
    assert len(rows) == 3 and s["mismatched_tokens_total"] == 0
    assert all(r["env/turns_mean"] == 2 and r["env/observation_tokens_mean"] == 5 for r in rows)
    assert all(r["reward/std"] > 0 for r in rows)  # the advantages are not zero: the updates move the weights
    for r in rows:
        assert r["mismatch/num_tokens"] == r["mismatch/completion_tokens"] > 0
        assert r["mismatch/num_mismatched_tokens"] == 0
    assert [r["offpolicy/versions_behind/token_mean"] for r in rows] == [0.0, 1.0, 1.0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RLRun, "stop_requested", lambda self: self.step == 2)
        assert train(_cfg(tmp_path, out="resumed", **mt), out=lambda *a: None)["stopped_early"]
    train(_cfg(tmp_path, out="resumed", **mt), resume=True, out=lambda *a: None)
    assert _untimed(_steps(tmp_path / "resumed")) == _untimed(rows)
    a, b = _weights(tmp_path / "full", 3), _weights(tmp_path / "resumed", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    train(_cfg(tmp_path, k=0, out="sync", **mt), out=lambda *a: None)
    c = _weights(tmp_path / "sync", 3)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_generation_worker_hands_back_results_and_errors():
    """The worker's job runs beside the caller; its value, or its exception (e.g. a prompt error while sampling
    the next batch), comes back at result(); one job at a time."""
    import threading

    from exactrl.train.offpolicy import GenerationWorker

    w = GenerationWorker("cpu")
    gate = threading.Event()
    w.start(lambda: gate.wait(5) and threading.current_thread().name)
    with pytest.raises(RuntimeError, match="already running"):
        w.start(lambda: None)
    assert w.busy
    gate.set()
    assert w.result() == "exactrl-generation" and not w.busy

    def fail():
        raise ValueError("prompt 3 is too long")

    w.start(fail)
    with pytest.raises(ValueError, match="prompt 3"):
        w.result()
    with pytest.raises(RuntimeError, match="no job"):
        w.result()
    w.start(lambda: 1)
    w.close()  # waits and drops the result
    assert not w.busy


def test_the_evaluation_engine_is_released_when_the_replica_engine_replaces_it(tmp_path, monkeypatch):
    """With an engine copy (k = 1) the engine that ran the held-out evaluation on the trainer's model is replaced:
    its KV cache and decode graphs go with it, not left to the cycle collector beside the new engine's."""
    replaced = []
    original = RLRun.build_trainer

    def spy(self):
        old = self.engine.runner
        original(self)
        replaced.append((old, self.engine.runner))

    monkeypatch.setattr(RLRun, "build_trainer", spy)
    run = RLRun(_cfg(tmp_path, train__steps=1), out=lambda *a: None)
    try:
        run.run()
    finally:
        run.close()
    ((old, new),) = replaced
    assert old is not None and old is not new  # the evaluation before RL ran in the replaced engine
    assert old._kv_flat is None and old._static is None
