"""End-to-end tests of `exactrl.train.loop.train`: resume, exactness, every algorithm, faults, recipes.

Every run is a few steps of the tiny preset on CPU (the quickstart's settings, shrunk). Most runs use a
reward plug-in that hashes the completion text, so rewards vary within a group and the updates are not zero (a
random tiny model never gets an arithmetic answer right, and all-zero rewards would make every test trivial).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import exactrl.train.trainer as trainer_mod
from exactrl.config import RunConfig, apply_overrides, config_from_dict, config_to_dict, load_config
from exactrl.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "exactrl_test_loop_rewards"

# configs/quickstart.toml as committed (that file is tuned by hand: a copy keeps these tests still), shrunk to 4 RL
# steps of 16 rollouts (4 prompts x 4), 4-token completions, 8 held-out prompts, 3 SFT steps, and rewarded by the
# hashing plug-in below.
BASE = {
    "run": {
        "name": "test",
        "seed": 0,
        "device": "cpu",
        "exact": True,
        "tensorboard": False,
        "report": False,
        "progress": False,
    },
    "model": {"preset": "tiny", "dtype": "float32"},
    "engine": {"block_size": 16, "max_num_seqs": 256, "max_model_len": 64},
    "sampling": {"temperature": 1.0, "max_tokens": 4},
    "task": {
        "name": "arithmetic",
        "arithmetic_max_operand": 30,
        "arithmetic_ops": ["+", "-"],
        "arithmetic_num_terms": 2,
        "use_chat_template": False,
        "num_eval": 8,
        "eval_every": 0,
        "max_prompt_tokens": 16,
    },
    "reward": {"functions": [f"{PLUGIN}:hashed"]},
    "algorithm": {"name": "grpo", "group_size": 4, "rollouts_per_step": 16, "aggregation": "token-mean"},
    "train": {"steps": 4, "lr": 3e-4, "max_tokens_per_microbatch": 4096, "save_every": 20},
    "sft": {"steps": 3, "lr": 3e-3, "batch_size": 8},
}

# The same shrinking for the recipe files (configs/quickstart-{gspo,ppo}.toml).
SMALL = [
    "train.steps=4",
    "train.warmup_steps=0",
    "train.lr_schedule=constant",
    "sft.steps=3",
    "sft.batch_size=8",
    "sft.warmup_steps=0",
    "algorithm.rollouts_per_step=16",
    "algorithm.group_size=4",
    "task.num_eval=8",
    "task.eval_every=0",
    "sampling.max_tokens=4",
    "run.progress=false",
    "run.tensorboard=false",
    "run.report=false",
    f'reward.functions=["{PLUGIN}:hashed"]',
]

PLUGIN_SOURCE = '''
"""Reward plug-ins for tests/train/test_loop.py."""
import fcntl
import hashlib
import json
import os
import signal
from pathlib import Path

# Reward calls run in worker processes: the simulated Ctrl-C is driven by a control file next to this module,
# {"calls": n, "kill_at": k, "pid": trainer}, updated under a lock by every worker.
CONTROL = Path(__file__).with_name("control.json")


def _score(completion):
    return (int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5) / 4


def hashed(completion, answer, example):
    if CONTROL.exists():
        with open(CONTROL, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            state = json.load(f)
            state["calls"] += 1
            f.seek(0)
            f.truncate()
            json.dump(state, f)
        if state["calls"] == state["kill_at"]:  # the kill_at-th call sends SIGINT to the trainer (a Ctrl-C)
            os.kill(state["pid"], signal.SIGINT)
    return _score(completion)


def flaky(completion, answer, example):
    s = _score(completion)
    if s < 0.5:
        raise ZeroDivisionError("flaky plug-in")
    return s
'''


# ----------------------------------------------------------------------------------------------------------
# Helpers and shared runs
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread for these runs: on a shared 2-core machine, OpenMP threads spin-waiting on each other
    make a tiny run 5-10x slower than one thread does (and every comparison here is at the same thread count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The reward plug-in module, importable by name for the whole module."""
    d = tmp_path_factory.mktemp("plugin")
    (d / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    sys.path.insert(0, str(d))
    importlib.invalidate_caches()
    mod = importlib.import_module(PLUGIN)
    yield mod
    sys.path.remove(str(d))
    sys.modules.pop(PLUGIN, None)


@pytest.fixture(autouse=True)
def _no_leftover_sigint_handler():
    """train() must put the SIGINT handler back."""
    before = signal.getsignal(signal.SIGINT)
    yield
    assert signal.getsignal(signal.SIGINT) is before


def cfg_for(out_dir: Path, *overrides: str, config: Path | None = None) -> RunConfig:
    """BASE (or a recipe file shrunk by SMALL) with output_dir and overrides, validated."""
    if config is not None:
        return load_config(config, [*SMALL, f"run.output_dir={out_dir}", *overrides])
    cfg = apply_overrides(config_from_dict(BASE), [f"run.output_dir={out_dir}", *overrides])
    cfg.validate()
    return cfg


def quiet(*_args) -> None:
    pass


def is_timing(key: str) -> bool:
    return key.startswith("perf/") or key.endswith("_s") or "tokens_per_s" in key or key == "minutes"


def records(run_dir: Path) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not is_timing(k)} for line in lines]


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "reward/mean" in r]


def latest(run_dir: Path) -> Path:
    root = Path(run_dir) / "checkpoints"
    return root / (root / "latest").read_text().strip()


def policy_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest(run_dir) / "policy" / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = policy_weights(a), policy_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def assert_same_optimizer(a: Path, b: Path) -> None:
    sa = torch.load(latest(a) / "optimizer.pt", weights_only=True)
    sb = torch.load(latest(b) / "optimizer.pt", weights_only=True)
    assert sa.keys() == sb.keys()
    for name in sa:
        ta, tb = sa[name]["opt"]["state"], sb[name]["opt"]["state"]
        assert ta.keys() == tb.keys()
        for i in ta:
            for k in ta[i]:
                assert torch.equal(torch.as_tensor(ta[i][k]), torch.as_tensor(tb[i][k])), (name, i, k)


def assert_finite_losses(run_dir: Path, *keys: str) -> list[dict]:
    steps = step_records(run_dir)
    assert steps, "no step records"
    for r in steps:
        for k in ("loss", *keys):
            assert r.get(k) is not None and math.isfinite(r[k]), (r["step"], k, r.get(k))
        assert r["nan_skipped"] == 0
        assert r["optimizer_steps"] >= 1
    return steps


# GRPO with a KL penalty to the (post-SFT) reference model, one held-out eval inside the RL loop (step 3): the
# run the resume, determinism and exactness tests compare against.
REFERENCE = ("algorithm.kl_coef=0.05", "task.eval_every=3")


@pytest.fixture(scope="module")
def reference_run(plugin, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    cfg = cfg_for(out, *REFERENCE, "run.report=true")  # BASE draws no report.png; the artifacts test reads it
    summary = train(cfg, out=quiet)
    return out, cfg, summary


# ----------------------------------------------------------------------------------------------------------
# 1. Resume and determinism
# ----------------------------------------------------------------------------------------------------------


def test_resume_is_bitwise(reference_run, tmp_path):
    ref_dir, _, ref_summary = reference_run
    run = tmp_path / "run"
    first = train(cfg_for(run, *REFERENCE, "train.steps=2"), out=quiet)
    assert first["rl_steps"] == 2 and not first["stopped_early"]
    lines: list[str] = []
    summary = train(cfg_for(run, *REFERENCE), resume=True, out=lines.append)
    assert any("resumed from" in line and "at step 2" in line for line in lines)
    assert summary["rl_steps"] == 4
    assert records(run) == records(ref_dir)
    assert_same_weights(run, ref_dir)
    assert_same_optimizer(run, ref_dir)
    strip = lambda s: {k: v for k, v in s.items() if not is_timing(k)}  # noqa: E731
    assert strip(summary) == strip(ref_summary)


def test_same_seed_same_run_other_seed_differs(reference_run, tmp_path):
    ref_dir, _, _ = reference_run
    train(cfg_for(tmp_path / "again", *REFERENCE), out=quiet)
    assert records(tmp_path / "again") == records(ref_dir)
    assert_same_weights(tmp_path / "again", ref_dir)

    train(cfg_for(tmp_path / "seed1", *REFERENCE, "run.seed=1", "train.steps=1"), out=quiet)
    other, ref = step_records(tmp_path / "seed1")[0], step_records(ref_dir)[0]
    assert other != ref


def test_resume_is_bitwise_in_bf16_with_fp32_lm_head(plugin, tmp_path):
    """bf16 weights with fp32 AdamW master copies (restored from optimizer.pt) and an fp32 LM head."""
    extra = ("model.dtype=bfloat16", "model.fp32_lm_head=true", "sft.steps=2", *REFERENCE)
    train(cfg_for(tmp_path / "full", "train.steps=2", *extra), out=quiet)
    train(cfg_for(tmp_path / "half", "train.steps=1", *extra), out=quiet)
    train(cfg_for(tmp_path / "half", "train.steps=2", *extra), resume=True, out=quiet)
    steps = assert_finite_losses(tmp_path / "full", "kl_ref")
    assert all(r["mismatch/num_mismatched_tokens"] == 0 for r in steps)
    assert records(tmp_path / "half") == records(tmp_path / "full")
    assert_same_weights(tmp_path / "half", tmp_path / "full")
    assert_same_optimizer(tmp_path / "half", tmp_path / "full")
    assert policy_weights(tmp_path / "full")["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_resume_without_checkpoint_starts_fresh(plugin, tmp_path):
    """--resume on a run dir that has no checkpoint yet starts from scratch and does not keep stale metrics."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "stale": true}\n')
    lines: list[str] = []
    train(cfg_for(run, "train.steps=1", "sft.steps=0"), resume=True, out=lines.append)
    assert any("no checkpoint" in line for line in lines)
    assert not any(r.get("stale") for r in records(run))
    assert [r["step"] for r in step_records(run)] == [1]


# ----------------------------------------------------------------------------------------------------------
# 2. Exactness and run artifacts
# ----------------------------------------------------------------------------------------------------------


def test_exact_on_every_step_and_artifacts(reference_run):
    run, cfg, summary = reference_run
    steps = assert_finite_losses(run, "kl_ref", "pg_loss", "entropy")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["mismatch/num_mismatched_tokens"] == 0, r["step"]
        assert r["mismatch/num_tokens"] > 0, r["step"]
        assert r["kl_ref"] is not None and math.isfinite(r["kl_ref"])
    assert steps[-1]["kl_ref"] > 0  # the policy moved away from the reference
    assert any(r["reward/std"] > 0 for r in steps)  # the plug-in reward is not constant
    assert "eval/accuracy" in steps[2] and "eval/accuracy" not in steps[0]  # task.eval_every = 3
    phases = [r.get("phase") for r in records(run) if "phase" in r]
    assert phases == ["before_rl", "after_rl"]

    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert summary["mismatched_tokens_total"] == 0
    assert summary["compared_tokens_total"] == sum(r["mismatch/num_tokens"] for r in steps) > 0
    for key in ("accuracy_before_rl", "accuracy_after_rl", "minutes", "rl_steps"):
        assert key in summary, key
    assert summary["rl_steps"] == 4 and summary["stopped_early"] is False and summary["exact"] is True

    for name in ("config.toml", "metrics.jsonl", "report.png", "summary.json", "checkpoints/latest"):
        assert (run / name).is_file(), name
    assert config_to_dict(load_config(run / "config.toml")) == config_to_dict(cfg)
    state = json.loads((latest(run) / "state.json").read_text())
    assert state["step"] == 4

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(latest(run) / "policy"))
    ours = policy_weights(run)
    hf_sd = hf.state_dict()
    shared = [k for k in ours if k in hf_sd]
    assert shared and all(torch.equal(hf_sd[k].float(), ours[k].float()) for k in shared)
    with torch.no_grad():
        logits = hf(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


# ----------------------------------------------------------------------------------------------------------
# 3. Algorithms and recipes
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, extra_keys",
    [
        (["algorithm.name=dr_grpo"], []),
        (["algorithm.name=rloo"], []),
        (
            ["run.exact=false", 'algorithm.rollout_correction="token-tis"'],
            ["mismatch/num_tokens", "mismatch/num_mismatched_tokens"],
        ),
    ],
    ids=["dr_grpo", "rloo", "fast-token-tis"],
)
def test_algorithms(plugin, tmp_path, overrides, extra_keys):
    summary = train(cfg_for(tmp_path, "train.steps=2", "sft.steps=0", *overrides), out=quiet)
    steps = assert_finite_losses(tmp_path, *extra_keys)
    assert summary["rl_steps"] == 2 and len(steps) == 2
    if "run.exact=false" in overrides:
        assert summary["exact"] is False
        for r in steps:
            assert any(k.startswith("rollout_corr/") for k in r), sorted(r)
            assert r["mismatch/num_tokens"] > 0


def test_metrics_do_not_depend_on_the_aggregation(plugin, tmp_path):
    """Same rollouts (same seed, no update yet at step 1) under two aggregations: entropy and kl_ref are per-token
    means either way, and `loss` is the aggregated objective itself (here: = pg_loss, one microbatch, no bonus)."""
    recs = {}
    for agg in ("token-mean", "seq-mean-token-mean"):
        run = tmp_path / agg
        overrides = ("train.steps=1", "sft.steps=0", "algorithm.kl_coef=0.05", f"algorithm.aggregation={agg}")
        train(cfg_for(run, *overrides), out=quiet)
        (recs[agg],) = assert_finite_losses(run, "entropy", "kl_ref", "pg_loss")
    a, b = recs["token-mean"], recs["seq-mean-token-mean"]
    assert a["num_tokens"] == b["num_tokens"]  # the same rollouts
    assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-6) and a["entropy"] > 0.1
    assert a["kl_ref"] == b["kl_ref"] == 0.0  # the policy is the reference before the first update
    for r in (a, b):
        assert r["loss"] == pytest.approx(r["pg_loss"], rel=1e-5, abs=1e-9)


def test_gspo_recipe(plugin, tmp_path):
    cfg = cfg_for(tmp_path, "train.steps=2", "sft.steps=0", config=ROOT / "configs" / "quickstart-gspo.toml")
    a = cfg.algorithm
    assert (a.name, a.eps_low, a.eps_high, a.aggregation) == ("gspo", 3e-4, 4e-4, "seq-mean-token-mean")
    summary = train(cfg, out=quiet)
    steps = assert_finite_losses(tmp_path)
    assert summary["algorithm"] == "gspo" and summary["mismatched_tokens_total"] == 0
    assert all(r["mismatch/num_mismatched_tokens"] == 0 for r in steps)


def test_ppo_recipe_and_resume(plugin, tmp_path):
    """PPO with a critic (GAE); resuming restores the critic and its optimizer too, bitwise."""
    recipe = ROOT / "configs" / "quickstart-ppo.toml"
    cfg = cfg_for(tmp_path / "full", "train.steps=2", "sft.steps=0", config=recipe)
    a = cfg.algorithm
    assert (a.name, a.gamma, a.lam) == ("ppo", 1.0, 0.95) and a.value_clip is not None
    train(cfg, out=quiet)
    steps = assert_finite_losses(tmp_path / "full", "vf_loss", "advantages/std")
    assert all(r["mismatch/num_mismatched_tokens"] == 0 for r in steps)
    assert (latest(tmp_path / "full") / "critic.safetensors").is_file()

    half = tmp_path / "half"
    train(cfg_for(half, "train.steps=1", "sft.steps=0", config=recipe), out=quiet)
    train(cfg_for(half, "train.steps=2", "sft.steps=0", config=recipe), resume=True, out=quiet)
    assert records(half) == records(tmp_path / "full")
    assert_same_weights(half, tmp_path / "full")
    assert_same_optimizer(half, tmp_path / "full")
    ca = load_file(str(latest(half) / "critic.safetensors"))
    cb = load_file(str(latest(tmp_path / "full") / "critic.safetensors"))
    assert all(torch.equal(ca[k], cb[k]) for k in ca)


def test_gsm8k_recipe_loads():
    cfg = load_config(ROOT / "configs" / "qwen3-0.6b-gsm8k.toml")
    assert cfg.task.name == "jsonl" and cfg.task.answer_field == "answer"
    assert cfg.task.path == "data/gsm8k/train.jsonl" and cfg.task.eval_path == "data/gsm8k/test.jsonl"
    assert cfg.model.path == "checkpoints/Qwen3-0.6B" and cfg.model.preset is None
    assert cfg.model.dtype == "bfloat16" and cfg.run.device == "cuda" and cfg.run.exact
    assert cfg.task.use_chat_template and "####" in cfg.task.system_prompt
    assert "boxed" in cfg.task.system_prompt
    assert cfg.sampling.max_tokens == 512
    a = cfg.algorithm
    assert (a.name, a.group_size, a.rollouts_per_step, a.kl_coef, a.eps_high, a.aggregation) == (
        "grpo",
        8,
        256,
        0.0,
        0.28,
        "token-mean",
    )
    assert cfg.train.lr == 1e-6 and cfg.sft.steps == 0
    assert cfg.engine.max_model_len >= cfg.task.max_prompt_tokens + cfg.sampling.max_tokens


def test_gsm8k_tools_recipe_loads():
    """The multi-turn GPU recipe cannot run here (no checkpoint): it loads, validates, and its environment
    resolves with its options; its limits leave room for the episode it describes."""
    from exactrl.envs.calculator import CalculatorEnv
    from exactrl.train.loop import env_setup

    cfg = load_config(ROOT / "configs" / "qwen3-gsm8k-tools.toml")
    assert cfg.model.path == "checkpoints/Qwen3-0.6B" and cfg.model.preset is None
    assert cfg.model.dtype == "bfloat16" and cfg.run.device == "cuda" and cfg.run.exact
    assert cfg.task.name == "jsonl" and cfg.task.path == "data/gsm8k/train.jsonl"
    assert (
        cfg.task.use_chat_template and "<calc>" in cfg.task.system_prompt and "####" in cfg.task.system_prompt
    )
    assert cfg.env.name == "calculator" and cfg.env.max_turns > 1 and cfg.sft.steps == 0
    env = env_setup(cfg)
    assert env.cls is CalculatorEnv and env.make().call_cost == 0.0 and env.make().format_penalty == 0.0
    assert env.settings.max_tokens_per_turn == cfg.sampling.max_tokens
    assert cfg.task.max_prompt_tokens + cfg.sampling.max_tokens <= cfg.env.max_episode_tokens
    assert cfg.env.max_episode_tokens <= cfg.engine.max_model_len <= cfg.train.max_tokens_per_microbatch


# ----------------------------------------------------------------------------------------------------------
# 4. Faults
# ----------------------------------------------------------------------------------------------------------


def test_reward_plugin_errors_are_counted(plugin, tmp_path):
    summary = train(
        cfg_for(tmp_path, "train.steps=2", "sft.steps=0", f'reward.functions=["{PLUGIN}:flaky"]'), out=quiet
    )
    steps = assert_finite_losses(tmp_path)
    assert all(r["reward/errors"] > 0 for r in steps)
    assert summary["reward_errors_total"] == sum(r["reward/errors"] for r in steps) > 0
    assert summary["rl_steps"] == 2


def test_unknown_reward_function_lists_builtins(tmp_path):
    with pytest.raises(ValueError, match="unknown reward function 'no_such_reward'") as err:
        train(cfg_for(tmp_path, 'reward.functions=["no_such_reward"]'), out=quiet)
    for name in ("exact_match", "format", "numeric_match"):
        assert name in str(err.value)


def test_missing_jsonl_names_the_path(plugin, tmp_path):  # the base config's reward plug-in must import
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match="nope/train.jsonl"):
        train(cfg_for(tmp_path / "run", "task.name=jsonl", f"task.path={missing}"), out=quiet)


def test_bad_jsonl_line_names_file_and_line(plugin, tmp_path):  # the base config's reward plug-in must import
    data = tmp_path / "data.jsonl"
    # Bad records are skipped and logged one by one; a file with none usable stops the run, naming them.
    data.write_text('{"question": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    with pytest.raises(ValueError, match=rf"{data}:2: invalid JSON"):
        train(cfg_for(tmp_path / "run", "task.name=jsonl", f"task.path={data}"), out=quiet)


def _write_jsonl(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return path


def test_too_long_prompts_are_skipped_and_counted(plugin, tmp_path):
    long_prompt = "1+" * 200 + "1="
    train_file = _write_jsonl(
        tmp_path / "train.jsonl", [(f"{i}+{i}=", str(2 * i)) for i in range(5)] + [(long_prompt, "201")]
    )
    eval_file = _write_jsonl(
        tmp_path / "eval.jsonl", [("7+1=", "8"), ("2+" * 100 + "2=", "202"), ("9+9=", "18")]
    )
    summary = train(
        cfg_for(
            tmp_path / "run",
            "task.name=jsonl",
            f"task.path={train_file}",
            f"task.eval_path={eval_file}",
            "task.max_prompt_tokens=16",
            "train.steps=3",  # 12 prompts: two passes over the 6 training examples, so the long one comes up
            "sft.steps=0",
        ),
        out=quiet,
    )
    steps = assert_finite_losses(tmp_path / "run")
    assert steps[-1]["prompts/skipped_total"] >= 2
    assert summary["skipped_prompts_total"] == steps[-1]["prompts/skipped_total"]
    evals = [r for r in records(tmp_path / "run") if r.get("phase")]
    assert all(r["eval/num_examples"] == 2 for r in evals)  # the long eval prompt is left out, not a crash


def test_all_prompts_too_long_is_an_error_not_a_hang(
    plugin, tmp_path
):  # the base config's reward plug-in must import
    train_file = _write_jsonl(tmp_path / "train.jsonl", [("1+" * 100 + f"{i}=", "1") for i in range(3)])
    eval_file = _write_jsonl(tmp_path / "eval.jsonl", [("1+1=", "2")])
    cfg = cfg_for(
        tmp_path / "run",
        "task.name=jsonl",
        f"task.path={train_file}",
        f"task.eval_path={eval_file}",
        "task.max_prompt_tokens=16",
        "sft.steps=0",
    )
    with pytest.raises(ValueError, match="task.max_prompt_tokens"):
        train(cfg, out=quiet)


def _nan_policy_loss(times: int):
    real = trainer_mod.policy_loss_terms
    calls = {"n": 0}

    def patched(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] <= times:
            loss = loss * float("nan")
        return loss, metrics

    return patched


def test_nan_steps_are_skipped_then_the_run_stops(plugin, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_mod, "policy_loss_terms", _nan_policy_loss(times=10**9))
    lines: list[str] = []
    cfg = cfg_for(tmp_path, "train.steps=4", "sft.steps=0", "train.max_nan_steps=2")
    with pytest.raises(RuntimeError, match=r"2 consecutive steps had a non-finite loss.*max_nan_steps = 2"):
        train(cfg, out=lines.append)
    assert sum("update skipped" in line for line in lines) == 2
    steps = step_records(tmp_path)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["nan_skipped"] == 1 and r["optimizer_steps"] == 0 and r["grad_norm"] is None
    assert not (tmp_path / "checkpoints").exists()


def test_a_nan_step_is_skipped_and_the_run_goes_on(plugin, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_mod, "policy_loss_terms", _nan_policy_loss(times=1))
    summary = train(cfg_for(tmp_path, "train.steps=2", "sft.steps=0", "train.max_nan_steps=2"), out=quiet)
    steps = step_records(tmp_path)
    assert [r["nan_skipped"] for r in steps] == [1, 0]
    assert steps[1]["optimizer_steps"] == 1 and math.isfinite(steps[1]["loss"])
    # The guard compared every model token of the skipped step too (the NaN is in the loss, not the logprobs).
    for r in steps:
        assert r["mismatch/num_tokens"] == r["mismatch/completion_tokens"] > 0
    assert summary["nan_steps_total"] == 1 and summary["rl_steps"] == 2


def test_ctrl_c_finishes_the_step_checkpoints_and_resumes(reference_run, plugin, tmp_path, monkeypatch):
    """A SIGINT during step 2 (sent by the reward plug-in) stops the run cleanly after that step; --resume then
    finishes it, and the result is bitwise the uninterrupted reference run."""
    ref_dir, _, _ = reference_run
    cfg = cfg_for(tmp_path, *REFERENCE)
    # reward calls: 8 held-out prompts before RL, 16 rollouts in step 1, then the first call of step 2
    control = plugin.CONTROL
    control.write_text(json.dumps({"calls": 0, "kill_at": 8 + 16 + 1, "pid": os.getpid()}))
    lines: list[str] = []
    try:
        summary = train(cfg, out=lines.append)
        calls = json.loads(control.read_text())["calls"]
    finally:
        control.unlink()
    assert calls > 8 + 16 + 1  # the signal really was sent
    assert summary["stopped_early"] is True and summary["rl_steps"] == 2
    assert any("stopped at step 2" in line for line in lines)
    assert latest(tmp_path).name == "step-000002"
    assert [r["step"] for r in step_records(tmp_path)] == [1, 2]

    summary = train(cfg, resume=True, out=quiet)
    assert summary["stopped_early"] is False and summary["rl_steps"] == 4
    assert records(tmp_path) == records(ref_dir)
    assert_same_weights(tmp_path, ref_dir)


def test_resume_of_a_finished_run_in_a_moved_dir(reference_run, tmp_path):
    """Resuming a run that already reached train.steps (from a copy of its directory: checkpoints hold no
    absolute paths) trains nothing more and leaves one after-RL evaluation in metrics.jsonl, not two."""
    ref_dir, _, ref_summary = reference_run
    moved = tmp_path / "moved"
    shutil.copytree(ref_dir, moved)
    summary = train(cfg_for(moved, *REFERENCE), resume=True, out=quiet)
    assert summary["rl_steps"] == 4 and summary["accuracy_after_rl"] == ref_summary["accuracy_after_rl"]
    assert records(moved) == records(ref_dir)
    assert_same_weights(moved, ref_dir)
