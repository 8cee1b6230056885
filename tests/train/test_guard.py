"""Exact mode's guard: every completion token is checked before an update uses it, and a difference fails closed.

The fault is injected the way a real one would show: the engine records one logprob one ulp off (torch.nextafter)
for one sample of one step. Then "abort" must stop with no update applied and the last checkpoint as the resume
point, "skip_step" must drop that batch and go on, "warn" must train on it and count it. Each mode runs with one
update per step (the training forward checks, the device skips) and with several (a scoring pass checks first).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import exactrl.engine.engine as engine_mod
from exactrl.config import config_from_dict
from exactrl.train.loop import train
from exactrl.train.stages import RunStages
from exactrl.train.trainer import MismatchError

REWARD = """
import hashlib

def hashed(completion, answer, example):
    return (int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5) / 4
"""


def _cfg(tmp_path: Path, **over) -> object:
    (tmp_path / "rw.py").write_text(REWARD)
    d = {
        "run": {
            "name": "g",
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
        "reward": {"functions": [f"{tmp_path / 'rw.py'}:hashed"]},
        "algorithm": {"name": "grpo", "group_size": 4, "rollouts_per_step": 16},
        "train": {"steps": 3, "lr": 3e-4, "save_every": 1},
        "sft": {"steps": 0},
    }
    for key, value in over.items():
        section, name = key.split("__")
        d[section][name] = value
    d["run"]["output_dir"] = str(tmp_path / "run")
    return config_from_dict(d)


# Several differing tokens in one sequence, as a real fault shows (a kernel off on some rows): the first one (1)
# is one ulp off, a later one (2) is the largest difference, the last one (3) one ulp again. A report or message
# that names the largest, or the last, difference instead of the first names position 2 or 3.
SEVERAL = {1: None, 2: 0.5, 3: None}  # position -> added value (None: one ulp toward 0)


@pytest.fixture
def fault_at_call(monkeypatch):
    """`fault_at_call(k)`: the k-th generate call (1-based) records its first sample's logprob one ulp off.
    `fault_at_call(k, SEVERAL)`: several logprobs of the first sample long enough for them, as SEVERAL says."""

    def arm(k: int, faults: dict[int, float | None] | None = None) -> None:
        faults = faults or {0: None}
        calls = {"n": 0}
        original = engine_mod._Generation.collect

        def collect(self, outputs):
            original(self, outputs)
            calls["n"] += 1
            if calls["n"] == k:
                need = max(faults) + 1
                smp = next(s for o in outputs for s in o.samples if len(s.token_ids) >= need)
                lp = smp.rollout_logprobs
                for pos, add in faults.items():
                    lp[pos] = torch.nextafter(lp[pos], torch.tensor(0.0)) if add is None else lp[pos] + add

        monkeypatch.setattr(engine_mod._Generation, "collect", collect)

    return arm


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("minibatches", [1, 2])
def test_every_token_is_checked(tmp_path, minibatches):
    """Coverage: the compared tokens are the step's completion tokens, with one update or several (PPO epochs)."""
    cfg = _cfg(tmp_path, algorithm__minibatches_per_rollout=minibatches, algorithm__ppo_epochs=minibatches)
    s = train(cfg, out=lambda *a: None)
    rows = [r for r in _metrics(tmp_path / "run") if "mismatch/num_tokens" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["mismatch/num_tokens"] == r["mismatch/completion_tokens"] > 0
        assert r["mismatch/num_mismatched_tokens"] == 0
    assert s["compared_tokens_total"] == sum(r["mismatch/completion_tokens"] for r in rows)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_abort_applies_nothing_and_leaves_a_resumable_run(tmp_path, fault_at_call, monkeypatch, minibatches):
    # Generate calls: 1 = the held-out evaluation before RL, then one per RL step: call 3 is step 2.
    fault_at_call(3)
    cfg = _cfg(tmp_path, algorithm__minibatches_per_rollout=minibatches)
    seen = {}
    original = RunStages.mismatch_abort

    def spy(self, step, sr, err):
        seen["weights"] = {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()}
        original(self, step, sr, err)

    monkeypatch.setattr(RunStages, "mismatch_abort", spy)
    with pytest.raises(MismatchError) as err:
        train(cfg, out=lambda *a: None)
    msg = str(err.value)
    assert "step 2" in msg and "no optimizer step was applied" in msg
    assert "completion position 0" in msg and "0x" in msg  # the hex floats of both logprobs
    run = tmp_path / "run"
    # The resume point is step 1, and the weights at the abort are exactly step 1's: nothing of step 2 applied.
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000001"
    saved = load_file(str(run / "checkpoints" / "step-000001" / "policy" / "model.safetensors"))
    state = seen["weights"]
    named = {k: v for k, v in state.items() if k in saved}
    assert named and all(torch.equal(saved[k], v) for k, v in named.items())
    # What replay needs.
    report = json.loads((run / "mismatch-000002" / "report.json").read_text())
    assert report["step"] == 2 and report["sequences"]
    # The run resumes from step 1 (no fault this time) and finishes.
    monkeypatch.setattr(RunStages, "mismatch_abort", original)
    monkeypatch.undo()
    s = train(cfg, resume=True, out=lambda *a: None)
    assert s["rl_steps"] == 3 and s["mismatched_tokens_total"] == 0


def test_skip_step_drops_the_batch_and_goes_on(tmp_path, fault_at_call):
    fault_at_call(3)
    s = train(_cfg(tmp_path, run__on_mismatch="skip_step"), out=lambda *a: None)
    rows = {r["step"]: r for r in _metrics(tmp_path / "run") if "mismatch/num_tokens" in r}
    assert rows[2]["mismatch/step_skipped"] == 1 and rows[2]["optimizer_steps"] == 0
    assert rows[2]["mismatch/num_mismatched_tokens"] == 1
    assert rows[1]["optimizer_steps"] == 1 and rows[3]["optimizer_steps"] == 1
    assert s["rl_steps"] == 3 and s["mismatch_skipped_steps_total"] == 1 and s["mismatched_tokens_total"] == 1


def test_warn_trains_on_and_counts(tmp_path, fault_at_call):
    fault_at_call(3)
    lines: list[str] = []
    s = train(_cfg(tmp_path, run__on_mismatch="warn"), out=lambda *a: lines.append(" ".join(map(str, a))))
    rows = {r["step"]: r for r in _metrics(tmp_path / "run") if "mismatch/num_tokens" in r}
    assert rows[2]["optimizer_steps"] == 1 and "mismatch/step_skipped" not in rows[2]
    assert s["mismatched_tokens_total"] == 1 and s["mismatch_skipped_steps_total"] == 0
    assert any("warning: step 2" in x for x in lines)


def _snapshot(stages: RunStages) -> dict:
    """Every parameter and every optimizer's state (fp32 masters, moments, step counts, lr), cloned."""

    def clone(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: clone(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clone(v) for v in x]
        return x

    return {
        "params": {k: clone(v) for k, v in stages.trainer.model.named_parameters()},
        "optimizers": {
            k: clone(o.state_dict())
            for k, o in (("policy", stages.opt), ("critic", stages.critic_opt))
            if o is not None
        },
    }


def _differences(a, b, where: str = "") -> list[str]:
    """The places where two snapshots are not bitwise equal (torch.equal on every tensor)."""
    if isinstance(a, torch.Tensor):
        return [] if torch.equal(a, b) else [where]
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list):
        assert len(a) == len(b), where
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


@pytest.mark.parametrize("minibatches", [1, 2])
def test_skip_step_leaves_weights_and_optimizer_bitwise_and_a_replay_report(
    tmp_path, fault_at_call, monkeypatch, minibatches
):
    """skip_step must apply nothing: every parameter and all optimizer state (masters, moments, step count) are
    bitwise what they were before the skipped step (negative control: the steps around it change them), and the
    skipped step leaves the replay report an abort leaves, naming the first differing position."""
    fault_at_call(3, SEVERAL)  # step 2
    seen: dict[int, tuple[dict, dict, dict]] = {}
    original = RunStages.update

    def spy(self, step, rollouts):
        before = _snapshot(self)
        m = original(self, step, rollouts)
        seen[step + 1] = (before, _snapshot(self), m)
        return m

    monkeypatch.setattr(RunStages, "update", spy)
    cfg = _cfg(tmp_path, run__on_mismatch="skip_step", algorithm__minibatches_per_rollout=minibatches)
    s = train(cfg, out=lambda *a: None)
    before, after, m = seen[2]
    assert m["mismatch/step_skipped"] == 1 and m["mismatch/num_mismatched_tokens"] == 3
    assert _differences(before, after) == []
    b, a, m = seen[3]  # negative control: the step after it was applied and changed both
    changed = _differences(b, a)
    assert m["optimizer_steps"] >= 1 and any(d.startswith(".params") for d in changed)
    assert any(".exp_avg" in d for d in changed) and any(d.endswith(".step") for d in changed)
    assert s["rl_steps"] == 3 and s["mismatch_skipped_steps_total"] == 1
    # The replay report of the skipped step, as an abort leaves it.
    run = tmp_path / "run"
    report = json.loads((run / "mismatch-000002" / "report.json").read_text())
    (seq,) = report["sequences"]
    assert report["step"] == 2 and seq["num_differing"] == 3 and seq["first_differing_position"] == 1
    assert (run / "mismatch-000002" / "policy" / "config.json").is_file()
    assert not (run / "mismatch-000001").exists() and not (run / "mismatch-000003").exists()


def test_abort_names_the_first_differing_position(tmp_path, fault_at_call):
    """Several tokens of one sequence differ; the first (position 1, one ulp) is not the largest difference
    (position 2) nor the last (position 3): the message and the report name position 1."""
    from exactrl.guard import abort_message

    fault_at_call(2, SEVERAL)  # step 1
    with pytest.raises(MismatchError) as err:
        train(_cfg(tmp_path), out=lambda *a: None)
    msg = str(err.value)
    assert "3 of " in msg and "completion position 1," in msg
    assert [p for _, p, _, _ in err.value.sequences] == [1]  # what the replay report is written from
    report_dir = tmp_path / "run" / "mismatch-000001"
    (rec,) = json.loads((report_dir / "report.json").read_text())["sequences"]
    assert rec["first_differing_position"] == 1 and rec["num_differing"] == 3
    assert "completion token 1 " in abort_message(report_dir)
