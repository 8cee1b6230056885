"""The mismatch report and `exactrl parity --replay` with real injected faults.

A tiny model samples a few completions with the engine; the trainer scores them (bitwise equal in exact mode).
Then one of three faults is planted: a recorded rollout logprob moved by one ulp (an engine-side fault that does
not happen again at replay), the trainer's logprob op adding one ulp at one row (a fault in the ops that does),
and one decoder layer's output nudged on the trainer's path only (found by the layer probe). Each is checked
against a clean report, which replays with exit 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import exactrl.model.loading as loading
from exactrl.cli import main
from exactrl.config import RunConfig, config_from_dict
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.guard import (
    MismatchSequence,
    abort_message,
    format_mismatch_error,
    read_mismatch_report,
    write_mismatch_report,
)
from exactrl.guard.replay import replay_report
from exactrl.model.hf import load_model
from exactrl.ops.torch_ops import ExactTorchOps
from exactrl.train.packing import completion_logprobs

TEMPERATURE = 0.7


def _cfg() -> RunConfig:
    cfg = config_from_dict(
        {
            "run": {"device": "cpu", "exact": True, "tensorboard": False, "report": False, "progress": False},
            "model": {"preset": "tiny", "dtype": "float32"},
            "engine": {"block_size": 16, "max_model_len": 64},
            "sampling": {"temperature": TEMPERATURE, "max_tokens": 6},
            "task": {"max_prompt_tokens": 16},
            "algorithm": {"group_size": 2, "rollouts_per_step": 4},
        }
    )
    cfg.validate()
    return cfg


@pytest.fixture(scope="module")
def sampled():
    """(cfg, model, tokenizer, sampling params, sequences with both logprob vectors)."""
    cfg = _cfg()
    model, tok = loading.load_policy(preset_name="tiny", device="cpu", dtype="float32", seed=3)
    model.requires_grad_(False)
    params = SamplingParams(
        temperature=TEMPERATURE, max_tokens=6, n=2, seed=11, stop_token_ids=tok.stop_token_ids
    )
    prompts = [tok.encode("7-2+9="), tok.encode("3+4-1=")]
    rids = [40, 41]
    outs = RolloutEngine(model, EngineConfig(max_model_len=64)).generate(prompts, params, request_ids=rids)
    seqs = []
    for rid, p, o in zip(rids, prompts, outs):
        for j, s in enumerate(o.samples):
            assert len(s.token_ids) >= 3, "a completion too short to plant a fault in"
            seqs.append((rid, j, p, s.token_ids, s.rollout_logprobs))
    trainer = completion_logprobs(
        model, [p + c for _, _, p, c, _ in seqs], [len(x[2]) for x in seqs], TEMPERATURE
    )
    out = [MismatchSequence(rid, j, p, c, r.clone(), t) for (rid, j, p, c, r), t in zip(seqs, trainer)]
    for s in out:  # exact mode: the premise of every test below
        assert torch.equal(s.rollout_logprobs, s.trainer_logprobs)
    return cfg, model, tok, params, out


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: on a shared 2-core machine two spinning OpenMP threads make these tiny calls slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _write(tmp_path: Path, sampled, sequences, step: int = 7, probe: bool = False) -> Path:
    """The report; the run-time layer probe only where a test reads its verdict (the replay probes again)."""
    cfg, model, tok, params, _ = sampled
    return write_mismatch_report(
        tmp_path,
        step,
        cfg=cfg,
        model=model,
        tokenizer=tok,
        sequences=sequences,
        sampling=params,
        probe_layers=probe,
    )


def _replay_cli(report: Path, capsys) -> tuple[int, str]:
    rc = main(["parity", "--replay", str(report)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def _one_ulp_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.tensor(float("inf"), dtype=x.dtype))


def test_report_holds_what_replay_needs(tmp_path, sampled):
    cfg, model, tok, params, seqs = sampled
    s = seqs[1]
    bad = MismatchSequence(
        s.request_id,
        s.sample_index,
        s.prompt_ids,
        s.completion_ids,
        s.rollout_logprobs.clone(),
        s.trainer_logprobs,
    )
    bad.rollout_logprobs[2] = _one_ulp_up(bad.rollout_logprobs[2])
    d = _write(tmp_path, sampled, [bad], probe=True)
    assert d == tmp_path / "mismatch-000007"
    rep = json.loads((d / "report.json").read_text())
    r = rep["sequences"][0]
    assert (
        rep["step"] == 7 and rep["sampling"]["seed"] == 11 and rep["sampling"]["temperature"] == TEMPERATURE
    )
    assert rep["config"]["sampling"]["max_tokens"] == 6 and (d / "config.toml").is_file()
    assert (r["request_id"], r["sample_index"]) == (s.request_id, s.sample_index)
    assert r["prompt_ids"] == s.prompt_ids and r["completion_ids"] == s.completion_ids
    assert r["first_differing_position"] == 2 and r["first_differing_token_id"] == s.completion_ids[2]
    assert r["rollout_logprobs_hex"][2] == float(bad.rollout_logprobs[2]).hex()
    assert r["rollout_logprobs_hex"][2] != r["trainer_logprobs_hex"][2]
    assert r["first_differing_layer"] is None  # exact mode: the paths agree at every layer
    # The hex values read back to the same bits; the policy is the sampling weights, bit for bit.
    _, back = read_mismatch_report(d)
    assert torch.equal(back[0].rollout_logprobs, bad.rollout_logprobs)
    assert torch.equal(back[0].trainer_logprobs, s.trainer_logprobs)
    saved = load_model(d / "policy").state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(saved[k], v), k
    abort = abort_message(d)
    assert "step 7" in abort and "completion token 2" in abort and f"exactrl parity --replay {d}" in abort
    msg = format_mismatch_error(7, bad)
    for part in (
        "step 7",
        f"request {s.request_id} sample {s.sample_index}",
        "completion token 2",
        f"id {s.completion_ids[2]}",
        float(bad.rollout_logprobs[2]).hex(),
        float(s.trainer_logprobs[2]).hex(),
    ):
        assert part in msg, (part, msg)


def test_clean_report_replays_with_exit_0(tmp_path, sampled, capsys):
    """Negative control for both fault tests: nothing planted, every check passes."""
    rc, out = _replay_cli(_write(tmp_path, sampled, sampled[4]), capsys)
    assert rc == 0, out
    assert "engine re-sampled the same tokens: yes" in out
    assert "recomputed: engine and trainer logprobs bitwise equal" in out
    assert "DIVERGE" not in out and "does not reproduce" not in out


def test_replay_finds_a_recorded_rollout_fault(tmp_path, sampled, capsys):
    """One recorded rollout logprob one ulp off (an engine-side fault at run time): the replay recomputes both
    sides equal, and says the recorded value does not reproduce at that position."""
    seqs = sampled[4]
    s = seqs[3]
    pos = 1
    lp = s.rollout_logprobs.clone()
    lp[pos] = _one_ulp_up(lp[pos])
    bad = MismatchSequence(
        s.request_id, s.sample_index, s.prompt_ids, s.completion_ids, lp, s.trainer_logprobs
    )
    rc, out = _replay_cli(_write(tmp_path, sampled, [seqs[0], bad]), capsys)
    assert rc == 1, out
    assert f"recorded mismatch at position {pos} (token id {s.completion_ids[pos]})" in out
    assert (
        f"recorded rollout logprob does not reproduce at position {pos} (token id {s.completion_ids[pos]})"
        in out
    )
    assert float(lp[pos]).hex() in out and float(s.rollout_logprobs[pos]).hex() in out
    assert "recomputed: DIVERGE" not in out  # the fault did not happen again


def test_replay_finds_a_fault_in_the_trainers_logprob_op(tmp_path, sampled, monkeypatch, capsys):
    """The trainer's logprob op adds one ulp at row 2 of every call (the engine records through
    logprobs_from_logits, untouched): the replay's recompute diverges at position 2 of the first sequence, and
    the layer probe clears the decoder layers."""
    d = _write(tmp_path, sampled, sampled[4])
    real = ExactTorchOps.logprobs

    def faulty(self, hidden, weight, targets, temperature=1.0, with_entropy=False):
        lp, ent = real(self, hidden, weight, targets, temperature, with_entropy)
        lp = lp.clone()
        lp[2] = _one_ulp_up(lp[2])
        return lp, ent

    monkeypatch.setattr(ExactTorchOps, "logprobs", faulty)
    rc, out = _replay_cli(d, capsys)
    assert rc == 1, out
    first = sampled[4][0]
    assert f"request {first.request_id} sample {first.sample_index}" in out
    assert f"recomputed: DIVERGE at position 2 (token id {first.completion_ids[2]})" in out
    assert "agree at every layer" in out


def test_layer_probe_names_the_faulty_layer(tmp_path, sampled, monkeypatch):
    """Layer 1's output scaled by 1 + 2**-10 on the trainer's path only (no KV cache), as a kernel that differs
    between the paths would: the probe names layer 1."""
    d = _write(tmp_path, sampled, sampled[4][:1])
    real = loading.load_policy

    def nudge(module, args, out):
        pending, h = out
        if args[6] is not None:  # the engine's path (kv_cache given): untouched
            return None
        return pending * (1 + 2**-10), h

    def load_with_fault(**kw):
        model, tok = real(**kw)
        model.model.layers[1].register_forward_hook(nudge)
        return model, tok

    monkeypatch.setattr(loading, "load_policy", load_with_fault)
    res = replay_report(d)
    assert not res.ok
    assert res.sequences[0].layer == 1, res.text()
