"""The RL loop with multi-turn episodes ([env]) and with LoRA ([lora]): exact end to end, on the tiny preset.

The engine-level properties (observations prefilled on the cached conversation, adapters through the invariant
ops, their negative controls) are tested in tests/engine/test_turns.py and tests/lora; these check that the loop
wires them: the guard compares every model token of every turn (and only those), the trainer masks the
environment's tokens, LoRA trains the adapters alone, and a LoRA run resumes from its adapters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from exactrl.config import load_config
from exactrl.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "train.steps=2",
    "train.warmup_steps=0",
    "sft.steps=0",
    "algorithm.rollouts_per_step=8",
    "algorithm.group_size=4",
    "task.num_eval=4",
    "task.eval_every=0",
    "run.progress=false",
    "run.tensorboard=false",
    "run.report=false",
    "sampling.temperature=0.9",
]


def _rows(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def test_multi_turn_episodes_are_exact_and_observations_are_masked(tmp_path):
    # "guess": the environment answers "Higher"/"Lower" until the number is found, so episodes last several turns.
    cfg = load_config(
        ROOT / "configs/quickstart.toml",
        SMALL
        + [
            f"run.output_dir={tmp_path / 'mt'}",
            "env.name=guess",
            "env.max_turns=3",
            "env.max_episode_tokens=64",
            "sampling.max_tokens=4",
        ],
    )
    s = train(cfg, out=lambda *a: None)
    rows = _rows(tmp_path / "mt")
    assert s["mismatched_tokens_total"] == 0 and s["compared_tokens_total"] > 0
    assert max(r["env/turns_mean"] for r in rows) > 1  # observations were prefilled and the episode went on
    for r in rows:
        # Every model token of the 8 episodes is compared (completion_tokens counts the model's tokens), and no
        # environment token is (an observation's recorded logprob is 0.0: compared, it would be a mismatch).
        assert r["mismatch/num_tokens"] == r["mismatch/completion_tokens"] == 8 * r["env/model_tokens_mean"]
        assert r["mismatch/num_mismatched_tokens"] == 0


REWARD = """
import hashlib

def hashed(completion, answer, example):
    return (int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5) / 4
"""


def _lora_overrides(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    """The shrunk quickstart with LoRA rank 4, into `out`. Rewards that vary within a group (a random tiny model
    never gets an answer right): the updates are not zero."""
    (tmp_path / "rw.py").write_text(REWARD)
    reward = f'reward.functions=["{tmp_path / "rw.py"}:hashed"]'
    return SMALL + [f"run.output_dir={out}", reward, "lora.rank=4", *extra]


def test_lora_trains_adapters_only_exactly_and_resumes(tmp_path):
    out = tmp_path / "lora"
    over = _lora_overrides(tmp_path, out, "algorithm.kl_coef=0.05", "train.save_every=1")
    s = train(load_config(ROOT / "configs/quickstart.toml", over), out=lambda *a: None)
    assert s["mismatched_tokens_total"] == 0 and s["compared_tokens_total"] > 0
    rows = _rows(out)
    assert all(r["perf/weight_sync_bytes"] > 0 for r in rows)
    assert all("kl_ref" in r for r in rows)  # the reference (adapters off) is in the loss
    ck1, ck2 = out / "checkpoints" / "step-000001", out / "checkpoints" / "step-000002"
    # The base weights never move; the adapters do.
    b1, b2 = (load_file(str(c / "policy" / "model.safetensors")) for c in (ck1, ck2))
    assert b1.keys() == b2.keys() and all(torch.equal(b1[k], b2[k]) for k in b1)
    # So the base is written once: step 2's policy/ files are hard links to step 1's (one copy on disk).
    for f in (ck1 / "policy").iterdir():
        assert (ck2 / "policy" / f.name).stat().st_ino == f.stat().st_ino, f.name
    a1, a2 = (load_file(str(c / "adapter" / "adapter_model.safetensors")) for c in (ck1, ck2))
    assert a1.keys() == a2.keys() and any(not torch.equal(a1[k], a2[k]) for k in a1)
    # Resume from step 1's adapters to step 2: the same step-2 adapters as the uninterrupted run.
    (out / "checkpoints" / "latest").write_text("step-000001\n")
    import shutil

    shutil.rmtree(ck2)
    s2 = train(load_config(ROOT / "configs/quickstart.toml", over), resume=True, out=lambda *a: None)
    assert s2["rl_steps"] == 2 and s2["mismatched_tokens_total"] == 0
    a2r = load_file(str(ck2 / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(a2[k], a2r[k]) for k in a2)


def test_generate_and_eval_on_a_lora_checkpoint_use_its_adapters(tmp_path, capsys):
    """A LoRA checkpoint's policy/ is the base alone: `generate` and `eval` given it load the adapters beside it
    (the trained policy: the same tokens and logprobs as the base with those adapters attached by hand), unless
    --base-only asks for the base."""
    from exactrl.cli import main
    from exactrl.engine.engine import EngineConfig, RolloutEngine
    from exactrl.engine.sampler import SamplingParams
    from exactrl.model.loading import load_policy
    from exactrl.model.lora import load_adapter

    out = tmp_path / "lora"
    # lora.alpha and lr: adapters that move the tiny model's outputs in two steps
    over = _lora_overrides(tmp_path, out, "lora.alpha=64", "train.lr=1e-2")
    train(load_config(ROOT / "configs/quickstart.toml", over), out=lambda *a: None)
    policy = out / "checkpoints" / "step-000002" / "policy"
    argv = ["generate", "--model", str(policy), "--prompt", "12+7=", "--prompt", "3*4=", "-n", "2"]
    argv += ["--temperature", "0.7", "--max-tokens", "8", "--seed", "3", "--json"]

    def run(*extra):
        capsys.readouterr()
        assert main([*argv, *extra]) == 0
        cap = capsys.readouterr()
        return [json.loads(x) for x in cap.out.splitlines()], cap.err

    tuned, err = run()
    assert "LoRA adapters" in err
    base, err = run("--base-only")
    assert "--base-only" in err
    assert [r["rollout_logprobs"] for r in tuned] != [r["rollout_logprobs"] for r in base]
    model, tok = load_policy(path=policy)
    load_adapter(model, policy.parent / "adapter")
    params = SamplingParams(temperature=0.7, max_tokens=8, seed=3, n=2, stop_token_ids=tok.stop_token_ids)
    outs = RolloutEngine(model, EngineConfig(num_kv_blocks=64), tokenizer=tok).generate(
        [tok.encode("12+7="), tok.encode("3*4=")], params
    )
    by_hand = [[float(x) for x in s.rollout_logprobs] for o in outs for s in o.samples]
    assert [r["rollout_logprobs"] for r in tuned] == by_hand
    # eval scores the trained policy too (the adapters said on stderr).
    assert main(["eval", "--model", str(policy), "--json"]) == 0
    assert "LoRA adapters" in capsys.readouterr().err


HINT_ENV = """
from exactrl.envs import Environment, StepResult


class Hint(Environment):
    stop = ["\\n"]

    def reset(self, example):
        self.answer = str(example.answer)

    def step(self, turn):
        if self.answer in turn.text:
            return StepResult(done=True, reward=1.0)
        return StepResult(observation=f"No. Hint: it has {len(self.answer)} characters.\\n")
"""


def test_a_users_environment_loads_from_the_working_directory(tmp_path, monkeypatch):
    """The README's custom environment, as a file in the current directory: it loads, and its episodes run
    exactly; a name that does not load is refused before anything is written."""
    (tmp_path / "readme_hint_env.py").write_text(HINT_ENV)
    monkeypatch.chdir(tmp_path)
    over = SMALL + ["env.max_turns=3", "env.max_episode_tokens=60", "train.steps=1"]
    cfg = load_config(ROOT / "configs/quickstart.toml", over + [f"run.output_dir={tmp_path / 'ok'}"])
    cfg.env.name = "readme_hint_env:Hint"
    s = train(cfg, out=lambda *a: None)
    assert s["mismatched_tokens_total"] == 0 and s["compared_tokens_total"] > 0
    assert _rows(tmp_path / "ok")[0]["env/turns_mean"] > 1
    bad = load_config(ROOT / "configs/quickstart.toml", over + [f"run.output_dir={tmp_path / 'bad'}"])
    bad.env.name = "no_such_module_here:Hint"
    import pytest

    with pytest.raises(ValueError, match="cannot load 'no_such_module_here:Hint'"):
        train(bad, out=lambda *a: None)
    assert not (tmp_path / "bad").exists()


def test_calculator_recipe_end_to_end_shrunk(tmp_path, capsys):
    """configs/quickstart-tools.toml as committed, shrunk: the warm start learns worked tool episodes (only the
    model's tokens: sft/tokens counts them), held-out accuracy is measured with the calculator answering (episodes
    in the eval metrics), and the GRPO step on calculator episodes is exact."""
    from exactrl.envs.calculator import CalculatorEnv
    from exactrl.train.loop import build_task

    out = tmp_path / "calc"
    over = [
        f"run.output_dir={out}",
        "sft.steps=2",
        "sft.batch_size=8",
        "sft.warmup_steps=0",
        "train.steps=1",
        "train.warmup_steps=0",
        "algorithm.rollouts_per_step=8",
        "algorithm.group_size=4",
        "task.num_eval=4",
        "run.progress=false",
        "run.tensorboard=false",
        "run.report=false",
    ]
    cfg = load_config(ROOT / "configs/quickstart-tools.toml", over)
    s = train(cfg, out=lambda *a: None)
    assert s["mismatched_tokens_total"] == 0 and s["compared_tokens_total"] > 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # The first SFT batch: the first 8 examples of the SFT stream, each "<calc>a*b</calc>" + answer + EOS learned,
    # its "<result>...</result>" not.
    stream = build_task(cfg).train_examples(seed=cfg.run.seed + 1_000_003)
    calc = CalculatorEnv(
        **cfg.env.options
    )  # the recipe's demo_call_share: some worked episodes answer directly
    demos = [calc.demonstration(next(stream)) for _ in range(8)]
    learned = sum(len(t.encode()) for d in demos for t, by_model in d if by_model) + 8
    first_sft = next(r for r in recs if r.get("sft_step") == 0)
    assert first_sft["sft/tokens"] == learned
    evals = [r for r in recs if "eval/accuracy" in r]
    assert [r["phase"] for r in evals] == ["before_rl", "after_rl"]
    episodes = 4 * cfg.task.eval_samples  # the recipe samples each held-out problem several times
    assert all(r["eval/env/episodes"] == episodes and r["eval/env/turns_mean"] >= 1 for r in evals)
    step = next(r for r in recs if '"loss"' in json.dumps(r) and "env/episodes" in r)
    assert step["env/episodes"] == 8 and step["mismatch/num_tokens"] == 8 * step["env/model_tokens_mean"]
    # `exactrl eval` on the run's checkpoint scores it as the run did: episodes through the calculator.
    from exactrl.cli import main

    assert main(["eval", "--model", str(out / "checkpoints/step-000001/policy"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["eval/env/episodes"] == episodes and res["eval/accuracy"] == evals[-1]["eval/accuracy"]
