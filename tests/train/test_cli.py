"""The `exactrl` command line, called in-process through `exactrl.cli.main` (one subprocess checks the script)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from exactrl.cli import main

# configs/quickstart.toml as committed, shrunk (that file is tuned by hand: a copy keeps these tests still).
SMALL_TOML = """
[run]
name = "cli-test"
device = "cpu"
progress = false
tensorboard = false
report = false

[model]
preset = "tiny"

[engine]
max_model_len = 64

[sampling]
max_tokens = 3

[task]
name = "arithmetic"
arithmetic_max_operand = 30
use_chat_template = false
num_eval = 4
max_prompt_tokens = 16

[algorithm]
group_size = 4
rollouts_per_step = 8

[train]
steps = 2
lr = 3e-4
max_tokens_per_microbatch = 4096

[sft]
steps = 2
lr = 3e-3
batch_size = 8
"""

PARITY_KEYS = {"mode", "device", "dtype", "num_tokens", "num_mismatched", "max_abs_diff"}


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread for these runs: on a shared 2-core machine, OpenMP threads spin-waiting on each other
    make a tiny run 5-10x slower than one thread does (and every comparison here is at the same thread count)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "small.toml"
    path.write_text(SMALL_TOML)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    assert main(["init-model", "--preset", "tiny", "--out", str(out)]) == 0
    return out


def test_init_model_writes_a_checkpoint(tiny_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tiny_dir / name).is_file(), name


def test_generate_reads_the_checkpoint(tiny_dir, capsys):
    capsys.readouterr()
    argv = ["generate", "--model", str(tiny_dir), "--prompt", "1+1=", "--max-tokens", "4", "--json"]
    assert main(argv) == 0
    (rec,) = json_lines(capsys.readouterr().out)
    assert rec["prompt"] == "1+1="
    assert 1 <= len(rec["token_ids"]) <= 4
    assert len(rec["rollout_logprobs"]) == len(rec["token_ids"])
    assert all(lp <= 0 for lp in rec["rollout_logprobs"])
    assert rec["finish_reason"] in ("length", "stop")
    assert isinstance(rec["completion"], str)
    # same seed, same sample
    assert main(argv) == 0
    assert json_lines(capsys.readouterr().out) == [rec]


def test_generate_missing_model_is_a_clean_error(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x", "--max-tokens", "2"])
    assert rc == 2
    assert "nope" in capsys.readouterr().err


GUESS = ["generate", "--preset", "tiny", "--env", "guess", "--prompt", "Guess:", "--answer", "300"]
GUESS += ["--max-turns", "3", "--max-tokens", "3", "--temperature", "1", "-n", "2"]


def test_generate_runs_an_environment_turn_by_turn(capsys):
    """`generate --env`: every model turn and every observation, in order, then the episode's end and reward.
    The random model never says 300, so the guessing game answers each turn and the episode runs to max_turns."""
    assert main([*GUESS, "--json"]) == 0
    recs = json_lines(capsys.readouterr().out)
    assert len(recs) == 2 and [r["sample"] for r in recs] == [0, 1]
    for r in recs:
        assert [t["role"] for t in r["turns"]] == ["model", "env", "model", "env", "model"]
        assert {t["text"] for t in r["turns"][1::2]} <= {"\nSay a number.\n", "\nHigher.\n", "\nLower.\n"}
        assert r["finish_reason"] == "max_turns" and r["reward"] == 0.0 and r["answer"] == "300"
        # The engine's ids, in order: the loss mask is False exactly at the environment's tokens.
        ids = [i for t in r["turns"] for i in t["token_ids"]]
        mask = [t["role"] == "model" for t in r["turns"] for _ in t["token_ids"]]
        assert r["loss_mask"] == mask and len(r["rollout_logprobs"]) == len(ids)
        assert all((lp < 0) == m or (lp == 0 and not m) for lp, m in zip(r["rollout_logprobs"], mask))
    assert main(GUESS) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== prompt 1, sample 1: 'Guess:'"
    assert [x.split("]")[0] for x in out[1:6]] == [
        "  [turn 1",
        "  [turn 1",
        "  [turn 2",
        "  [turn 2",
        "  [turn 3",
    ]
    assert "model:" in out[1] and "env:" in out[2]
    assert out[6].startswith("  -> max_turns: reward 0, 3 turns, 0 tool calls")
    assert out[7] == "== prompt 1, sample 2: 'Guess:'"


def test_generate_env_refuses_bad_arguments(capsys):
    for argv, err in (
        ([*GUESS, "--answer", "1"], "--answer: give one per prompt (1 prompts), got 2"),
        (["generate", "--prompt", "x", "--answer", "1"], "add --env NAME"),
        (
            [*GUESS[:4], "calculator", *GUESS[5:], "--env-option", "call_cost=2"],
            "call_cost must be a number in [0, 1]",
        ),
        ([*GUESS, "--env-option", "nope=1"], "env.options: 'guess' (GuessNumberEnv) does not take"),
        ([*GUESS[:4], "chess", *GUESS[5:]], "unknown environment 'chess'"),
    ):
        assert main(argv) == 2, argv
        assert err in capsys.readouterr().err


PARITY = ["parity", "--preset", "tiny", "--device", "cpu", "--num-prompts", "4", "--max-tokens", "8"]


def test_parity_exact_exercises_what_rl_does(capsys):
    """The defaults fork groups (copy-on-write), hit the prefix cache, preempt and chunk prefills at T = 0.7."""
    assert main([*PARITY, "--json"]) == 0
    captured = capsys.readouterr()
    (rec,) = json_lines(captured.out)
    assert PARITY_KEYS <= rec.keys()
    assert (rec["mode"], rec["device"], rec["dtype"]) == ("exact", "cpu", "float32")
    assert rec["num_tokens"] > 0 and rec["temperature"] == 0.7 and rec["samples_per_prompt"] == 4
    assert rec["num_mismatched"] == 0 and rec["max_abs_diff"] == 0.0
    assert rec["tokens_identical_across_compositions"] and rec["ok"]
    for key in ("preemptions", "prefix_hit_blocks", "fork_shared_blocks", "cow_copies"):
        assert rec[key] > 0, key
    assert (
        "exercised:" in captured.err and "preemptions" in captured.err and "NOT exercised" not in captured.err
    )


def test_parity_fast_shows_mismatches_and_exits_1(capsys):
    assert main([*PARITY, "--mode", "fast", "--json"]) == 1
    captured = capsys.readouterr()
    (rec,) = json_lines(captured.out)
    assert PARITY_KEYS <= rec.keys()
    assert rec["mode"] == "fast" and rec["num_tokens"] > 0
    assert rec["num_mismatched"] > 0 and rec["max_abs_diff"] > 0
    assert "logprobs differ" in captured.err


def test_parity_fails_when_sampling_depends_on_the_batch_row(monkeypatch, capsys):
    """A planted bug: the Gumbel noise keyed on the row of the batch instead of the request. Logprobs still agree
    (they are recorded for whatever token was drawn), so only the token comparison across compositions sees it."""
    import torch

    import exactrl.engine.sampler as sampler

    real = sampler.gumbel_noise

    def row_keyed(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
        return real(torch.arange(len(keys), device=keys.device) + 12345, vocab_size)

    monkeypatch.setattr(sampler, "gumbel_noise", row_keyed)
    assert main([*PARITY, "--json"]) == 1
    captured = capsys.readouterr()
    (rec,) = json_lines(captured.out)
    assert rec["num_mismatched"] == 0 and not rec["tokens_identical_across_compositions"]
    assert rec["sequences_with_other_tokens"] > 0
    assert "other tokens in another batch composition" in captured.err


def test_train_unknown_key_exits_2_with_a_hint(config, capsys):
    assert main(["train", str(config), "--set", "train.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'train.lrr'" in err and "did you mean 'train.lr'?" in err


def test_train_unknown_section_exits_2_from_the_script(config):
    """The installed `exactrl` script: exit status 2 and the list of valid sections, no traceback."""
    exe = shutil.which("exactrl", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "exactrl.cli"]
    proc = subprocess.run(
        [*cmd, "train", str(config), "--set", "bogus.key=1"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "unknown section '[bogus]'" in proc.stderr
    assert "valid keys: run, model, engine" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_eval(tiny_dir, capsys):
    argv = [
        "eval",
        "--model",
        str(tiny_dir),
        "--task",
        "arithmetic",
        "--num",
        "8",
        "--max-tokens",
        "8",
        "--json",
    ]
    assert main(argv) == 0
    (rec,) = json_lines(capsys.readouterr().out)
    assert rec["eval/num_examples"] == 8
    assert 0 <= rec["eval/accuracy"] <= 1 and 0 <= rec["eval/reward"] <= 1


def test_eval_uses_the_config_stop_strings(tiny_dir, config, monkeypatch, capsys):
    """`exactrl eval --config C` scores like the held-out evaluation of `exactrl train C` (same stop strings)."""
    import exactrl.train.loop as loop

    seen = {}
    real = loop.evaluate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", spy)
    argv = ["eval", "--model", str(tiny_dir), "--config", str(config), "--num", "2", "--max-tokens", "3"]
    assert main([*argv, "--set", 'sampling.stop=["="]', "--json"]) == 0
    assert seen["stop"] == ["="] and seen["max_tokens"] == 3
    assert json_lines(capsys.readouterr().out)[0]["eval/num_examples"] == 2


def _jsonl(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    return path


def test_eval_takes_the_task_from_the_config(tiny_dir, config, tmp_path, capsys):
    train_file = _jsonl(tmp_path / "train.jsonl", [(f"{i}+2=", str(i + 2)) for i in range(4)])
    eval_file = _jsonl(tmp_path / "eval.jsonl", [(f"{i}+1=", str(i + 1)) for i in range(3)])
    cfg = tmp_path / "c.toml"
    task = f'name = "jsonl"\npath = "{train_file}"\neval_path = "{eval_file}"'
    cfg.write_text(config.read_text().replace('name = "arithmetic"', task))
    assert main(["eval", "--model", str(tiny_dir), "--config", str(cfg), "--max-tokens", "2", "--json"]) == 0
    # all 3 of the eval JSONL (task.num_eval = 4 arithmetic problems would be 4)
    assert json_lines(capsys.readouterr().out)[0]["eval/num_examples"] == 3


def test_eval_on_a_jsonl_file(tiny_dir, tmp_path, capsys):
    data = _jsonl(tmp_path / "d.jsonl", [(f"{i}+1=", str(i + 1)) for i in range(6)])
    argv = ["eval", "--model", str(tiny_dir), "--task", "jsonl", "--data", str(data), "--max-tokens", "2"]
    assert main([*argv, "--json"]) == 0
    assert json_lines(capsys.readouterr().out)[0]["eval/num_examples"] == 6  # all of them
    assert main([*argv, "--num", "4", "--json"]) == 0
    assert json_lines(capsys.readouterr().out)[0]["eval/num_examples"] == 4


def test_eval_jsonl_without_data_exits_2(tiny_dir, capsys):
    assert main(["eval", "--model", str(tiny_dir), "--task", "jsonl"]) == 2
    assert "task.path" in capsys.readouterr().err


def test_train_resume_and_report(config, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", str(config), "--set", f"run.output_dir={run}"]
    assert main([*argv, "--set", "train.steps=1"]) == 0
    # run.report = false (the config's): no report.png, and the summary line does not name one
    assert not (run / "report.png").exists() and "report.png" not in capsys.readouterr().out
    assert main([*argv, "--resume", "--set", "run.report=true"]) == 0  # on to train.steps = 2; a harmless key
    assert (run / "report.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 1" in out and "mismatch 0/" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["mismatched_tokens_total"] == 0

    (run / "report.png").unlink()
    assert main(["report", str(run)]) == 0
    assert str(run / "report.png") in capsys.readouterr().out
    assert (run / "report.png").stat().st_size > 0
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").is_file()


def test_report_without_metrics_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_sft_command(config, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["sft", str(config), "--set", f"run.output_dir={run}"]) == 0
    assert (run / "sft" / "model.safetensors").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rl_steps"] == 0 and summary["accuracy_before_rl"] is not None
    # the SFT checkpoint is a model the other commands read
    assert main(["eval", "--model", str(run / "sft"), "--num", "4", "--max-tokens", "3", "--json"]) == 0
    assert json_lines(capsys.readouterr().out)[-1]["eval/num_examples"] == 4


# ----------------------------------------------------------------------------------------------------------
# A user's first day (issue 24): run dirs, eval of a run's checkpoint, the small CLI items
# ----------------------------------------------------------------------------------------------------------


VALIDATIONS: list[int] = []  # RunConfig.validate's calls in small_run's `exactrl train`


@pytest.fixture(scope="module")
def small_run(config, tmp_path_factory) -> Path:
    """One RL step of the small config (its final model is checkpoints/step-000001); counts the config's
    validations in this process (VALIDATIONS)."""
    from exactrl.config import RunConfig

    run = tmp_path_factory.mktemp("small_run") / "run"
    real = RunConfig.validate
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RunConfig, "validate", lambda cfg: VALIDATIONS.append(1) or real(cfg))
        assert main(["train", str(config), "--set", f"run.output_dir={run}", "--set", "train.steps=1"]) == 0
    return run


def test_one_train_validates_its_config_once(small_run):
    """`exactrl train` in one process resolves its config once (exactrl.train.resolved.resolve_run) and the run
    takes that: one validation, not one per layer that looks at the config."""
    assert len(VALIDATIONS) == 1


def test_train_into_a_run_dir_refuses_without_resume_or_overwrite(config, small_run, capsys):
    before = (small_run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", str(config), "--set", f"run.output_dir={small_run}"]) == 2
    err = capsys.readouterr().err
    assert str(small_run) in err and "--resume" in err and "--overwrite" in err
    assert (small_run / "metrics.jsonl").read_text() == before


def test_resume_refuses_a_change_of_algorithm_or_lr(config, small_run, capsys):
    config_before = (small_run / "config.toml").read_text()
    argv = ["train", str(config), "--set", f"run.output_dir={small_run}", "--resume"]
    assert main([*argv, "--set", "algorithm.name=rloo", "--set", "train.lr=1e-2"]) == 2
    err = capsys.readouterr().err
    assert 'algorithm.name: "grpo" -> "rloo"' in err and "train.lr: 0.0003 -> 0.01" in err
    assert "--allow-config-change" in err
    assert (small_run / "config.toml").read_text() == config_before


def test_overwrite_starts_the_run_over(config, small_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    (run / "checkpoints" / "step-000099").mkdir()  # a stray old checkpoint must not survive
    argv = ["train", str(config), "--set", f"run.output_dir={run}", "--set", "train.steps=1"]
    assert main([*argv, "--set", "sft.steps=1", "--overwrite"]) == 0
    assert "--overwrite: the previous run's" in capsys.readouterr().out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000001"]
    assert "steps = 1" in (run / "config.toml").read_text().split("[sft]")[1]


def test_eval_of_a_runs_checkpoint_uses_the_runs_config(small_run, capsys):
    """`exactrl eval --model RUN/checkpoints/step-N/policy`, no other flag: the run's task, sampling and number of
    held-out prompts, so it prints the accuracy the run logged for that model."""
    capsys.readouterr()
    model = small_run / "checkpoints" / "step-000001" / "policy"
    assert main(["eval", "--model", str(model), "--json"]) == 0
    captured = capsys.readouterr()
    assert str(small_run / "config.toml") in captured.err
    (res,) = json_lines(captured.out)
    after = [json.loads(x) for x in (small_run / "metrics.jsonl").read_text().splitlines()]
    (after,) = [r for r in after if r.get("phase") == "after_rl"]
    assert res["eval/num_examples"] == 4  # the config's task.num_eval (200 without the run's config)
    assert res["eval/accuracy"] == after["eval/accuracy"] and res["eval/reward"] == after["eval/reward"]


def test_help_shows_defaults(capsys):
    for cmd, expected in (("eval", "(default: 0)"), ("parity", "(default: 6)"), ("bench", "(default: 256)")):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert expected in capsys.readouterr().out, cmd


def test_init_model_lists_presets(capsys):
    assert main(["init-model", "--list"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "qwen3-0.6b" in out and "layers" in out
    assert main(["init-model", "--preset", "tinyy", "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "tinyy" in err and "qwen3-0.6b" in err


def test_set_model_path_over_a_preset_explains_the_conflict(config, tmp_path, capsys):
    assert main(["train", str(config), "--set", f"model.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "model.preset=none" in err and "'tiny'" in err


def test_bench_writes_under_the_output_dir_it_is_given(tmp_path, capsys):
    argv = "bench rollout --preset tiny --device cpu --dtype float32 --concurrency 2 --prompt-len 4 --max-tokens 2"
    assert main([*argv.split(), "--output-dir", str(tmp_path / "out")]) == 0
    (written,) = (tmp_path / "out").iterdir()
    assert json.loads(written.read_text())["bench"] == "rollout"
    assert str(written) in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------
# Nothing lost (trust issue): SIGTERM checkpoints, SFT resumes from its own checkpoints, a resume that cannot
# load is refused before the run folder changes
# ----------------------------------------------------------------------------------------------------------


def _tree(run: Path) -> dict[str, tuple[int, int]]:
    """Every file under `run` with its size and modification time: what "nothing changed" compares."""
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")}


def _rl_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    # Complete lines only: the run may be writing the last one while this reads.
    rows = [json.loads(x) for x in path.read_text().split("\n")[:-1] if x.strip()]
    return [r["step"] for r in rows if "mismatch/num_tokens" in r]


@pytest.mark.parametrize("nproc", [None, pytest.param(2, marks=pytest.mark.slow)])
def test_sigterm_checkpoints_mid_run_and_resume_continues(config, tmp_path, capsys, nproc):
    """What a scheduler does before preemption: SIGTERM to `exactrl train` in the middle of its RL steps. The
    step in flight finishes, a checkpoint is written (save_every = 0: no other could exist), the exit status is
    143; `--resume` continues from that checkpoint, not from the start. With --nproc 2 the signal goes to the
    launcher alone: torchrun's agent and both ranks get it, and every rank stops at the same step (a sharded
    checkpoint, resumed here at world size 1)."""
    run = tmp_path / "run"
    root = Path(__file__).resolve().parents[2]
    argv = ["train", str(config), "--set", f"run.output_dir={run}", "--set", "sft.steps=0"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exactrl.cli",
            *argv,
            *(["--nproc", str(nproc)] if nproc else []),
            "--set",
            "train.steps=500",
            "--set",
            "train.save_every=0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=root,
    )
    try:
        deadline = time.monotonic() + 180
        while not _rl_steps(run):  # mid-run: at least one RL step is done
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no RL step within 180 s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    assert "SIGTERM: finishing this step, then writing a checkpoint" in out
    latest = (run / "checkpoints" / "latest").read_text().strip()
    k = int(latest.removeprefix("step-"))
    assert 1 <= k < 500 and _rl_steps(run)[-1] == k
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["stopped_early"] is True and summary["stopped_by"] == "SIGTERM" and summary["rl_steps"] == k
    )
    assert (run / "checkpoints" / latest / "dcp").is_dir() == bool(nproc)
    capsys.readouterr()
    assert main([*argv, "--set", f"train.steps={k + 1}", "--set", "train.save_every=0", "--resume"]) == 0
    assert f"resumed from {run / 'checkpoints' / latest} at step {k}" in capsys.readouterr().out
    assert json.loads((run / "summary.json").read_text())["rl_steps"] == k + 1
    assert _rl_steps(run) == list(range(1, k + 2))  # each step logged once: none lost, none twice


def test_sigterm_in_sft_resumes_sft_from_its_checkpoint_to_the_same_bits(
    config, tmp_path, monkeypatch, capsys
):
    """SIGTERM while SFT step 3 of 4 runs: SFT stops after it with a checkpoint; `--resume` runs step 4 alone and
    ends with the weights of an uninterrupted SFT, bit for bit (data position, optimizer and lr schedule restored).
    A later resume skips the finished SFT; sft/ of unknown progress is never overwritten silently."""
    from safetensors.torch import load_file

    import exactrl.train.sft as sft_mod

    ref, run = tmp_path / "ref", tmp_path / "run"
    base = ["sft", str(config), "--set", "sft.steps=4", "--set", "sft.batch_size=4"]
    assert main([*base, "--set", f"run.output_dir={ref}"]) == 0

    real, calls = sft_mod.sft_step, []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3 and stop_at_3:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's SIGTERM while step 3 runs
        return real(*args, **kwargs)

    monkeypatch.setattr(sft_mod, "sft_step", counted)
    stop_at_3 = True
    argv = [*base, "--set", f"run.output_dir={run}", "--set", "sft.save_every=2"]
    assert main(argv) == 143
    assert len(calls) == 3
    assert (run / "sft-checkpoints" / "latest").read_text().strip() == "step-000003"
    assert json.loads((run / "sft" / "sft_state.json").read_text())["finished"] is False
    assert "continues SFT from" in capsys.readouterr().out

    stop_at_3, calls[:] = False, []
    t0 = time.monotonic()
    assert main([*argv, "--resume"]) == 0
    wall = time.monotonic() - t0
    assert len(calls) == 1  # step 4 only: not restarted from step 0
    assert "SFT: continuing from step 3 of 4" in capsys.readouterr().out
    ours, theirs = (
        load_file(str(run / "sft" / "model.safetensors")),
        load_file(str(ref / "sft" / "model.safetensors")),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.loads((run / "sft" / "sft_state.json").read_text())["finished"] is True
    assert not (run / "sft-checkpoints").exists()  # a finished SFT needs no resume points
    sft_rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r["sft_step"] for r in sft_rows if "sft_step" in r]
    assert logged == sorted(set(logged)) and logged[-1] == 3  # no SFT step logged twice

    # The resumed SFT's minutes (both invocations) are SFT's, not RL's: the summary splits them.
    sft_s = json.loads((run / "sft" / "sft_state.json").read_text())["elapsed_s"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sft_elapsed_s"] == sft_s and summary["rl_steps"] == 0
    assert summary["rl_elapsed_s"] == pytest.approx(summary["minutes"] * 60 - sft_s)
    assert 0 <= summary["rl_elapsed_s"] <= wall  # the time after SFT lies inside the resumed call

    # A resume of a run whose SFT finished (no RL checkpoint yet): SFT is not run again.
    calls[:] = []
    assert main(["train", *argv[1:], "--set", "train.steps=1", "--resume"]) == 0
    out = capsys.readouterr().out
    assert calls == [] and "SFT finished earlier (4 steps)" in out
    assert "1 RL steps in " in out and f"min after {sft_s / 60:.1f} min of SFT" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sft_elapsed_s"] == sft_s

    # sft/ without its state (an older run) and no RL or SFT checkpoint: refused, nothing touched.
    shutil.rmtree(run / "checkpoints")
    (run / "sft" / "sft_state.json").unlink()
    before = _tree(run)
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "would start SFT over and overwrite them" in err and "sft.checkpoint=" in err
    assert _tree(run) == before and calls == []


def test_resume_into_another_model_shape_is_refused_before_anything_changes(
    config, small_run, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    before = _tree(run)
    argv = ["train", str(config), "--set", f"run.output_dir={run}", "--resume", "--allow-config-change"]
    assert main([*argv, "--set", "model.preset=tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume from {run / 'checkpoints' / 'step-000001'}" in err
    assert "architecture qwen3 (checkpoint) vs llama (this config's model)" in err
    assert _tree(run) == before  # config.toml, metrics.jsonl: untouched
    # Trainable state the checkpoint lacks: LoRA adapters, a PPO critic.
    assert main([*argv, "--set", "lora.rank=4"]) == 2
    assert "holds no LoRA adapters (no adapter/), and this config trains them" in capsys.readouterr().err
    assert main([*argv, "--set", "algorithm.name=ppo"]) == 2
    assert "critic.safetensors is missing" in capsys.readouterr().err
    assert _tree(run) == before


def test_resume_from_a_corrupt_checkpoint_is_refused_before_anything_changes(
    config, small_run, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    weights = run / "checkpoints" / "step-000001" / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # cut short, as by a full disk
    before = _tree(run)
    assert main(["train", str(config), "--set", f"run.output_dir={run}", "--resume"]) == 2
    err = capsys.readouterr().err
    assert str(weights) in err and "truncated or corrupt" in err
    assert _tree(run) == before
    # `latest` naming a checkpoint that is gone: refused too, not a silent start over.
    shutil.rmtree(run / "checkpoints" / "step-000001")
    before = _tree(run)
    assert main(["train", str(config), "--set", f"run.output_dir={run}", "--resume"]) == 2
    assert "'step-000001', which is not a checkpoint folder" in capsys.readouterr().err
    assert _tree(run) == before


def test_a_repeated_stop_signal_aborts_one_process_but_not_a_torchrun_rank(monkeypatch):
    """A rank under torchrun gets one stop twice (from the scheduler or terminal, and from torchrun's agent): the
    repeat must not abort its checkpoint. One process: a second Ctrl-C still gives up waiting."""
    from exactrl.train.loop import _StopFlag

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(KeyboardInterrupt), _StopFlag() as flag:
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.stop and flag.signal_name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        with _StopFlag() as flag:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the agent's copy
    except KeyboardInterrupt:
        pytest.fail("the agent's copy of the stop signal aborted the rank (no checkpoint)")
    assert flag.stop and flag.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers given back
