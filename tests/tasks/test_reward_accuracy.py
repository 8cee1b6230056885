"""Accuracy is the correctness verdict, not the summed reward; failing reward functions are loud and named; verl's
compute_score works as it is.

Units on `RewardComputer` first, then two tiny CPU runs through `exactrl train` (the loop's held-out evaluation,
step metrics, summary and exit status)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from exactrl.config import ConfigError, load_config
from exactrl.tasks import Example, RewardComputer, resolve_reward
from exactrl.tasks.rewards import accuracy_function

EX = Example(prompt="12+7-3=", answer="16", meta={})

# A user's reward file. Line numbers matter: the tests check that errors name `broken`'s line.
USER_REWARDS = """\
def wrong(completion, answer, example):
    return 0.0


def broken(completion, answer, example):
    return 1 / 0  # line 6


def always_one(completion, answer, example):
    return 1.0


def huge(completion, answer, example):
    return 1e300 if completion == "huge" else 1.0


def helper_fails(completion, answer, example):
    return _parse(completion)  # line 18


def _parse(text):
    return int(text)  # line 22: raises for "x"


def lib_fails(completion, answer, example):
    import json
    return json.loads(completion)  # line 27: raises deep inside the json package


def sleeps(completion, answer, example):
    import time
    if completion == "slow":
        time.sleep(60)  # far past any timeout the tests set: the call is stopped, never finished
    return 1.0


def hangs(completion, answer, example):
    import time
    time.sleep(60)
    return 1.0
"""


@pytest.fixture()
def user_dir(tmp_path: Path) -> Path:
    (tmp_path / "rw.py").write_text(USER_REWARDS)
    return tmp_path


# ---------------------------------------------------------------------------------------------------------------
# Which function is the verdict


def test_accuracy_function_rules(caplog: pytest.LogCaptureFixture) -> None:
    # Exactly one built-in correctness function: it, wherever it is listed.
    assert accuracy_function(["format", "my.py:len_bonus", "numeric_match"]) == "numeric_match"
    # Otherwise the first function that is not a known shaping reward (the README's own list).
    assert accuracy_function(["my_rewards.py:correct", "format"]) == "my_rewards.py:correct"
    assert accuracy_function(["format", "exact_match", "numeric_match"]) == "exact_match"
    # Only shaping rewards: no verdict (not reported), said once when a computer is built.
    assert accuracy_function(["format"]) is None
    with caplog.at_level(logging.WARNING, logger="exactrl.tasks.rewards"):
        with RewardComputer(["format"]) as rc:
            assert rc.accuracy_fn is None
            assert rc(["16"], ["16"], [EX]).correct is None
    assert [r.message for r in caplog.records if "accuracy is not reported" in r.message], caplog.text
    # Named, or turned off.
    assert accuracy_function(["numeric_match", "format"], "format") == "format"
    assert accuracy_function(["numeric_match"], "off") is None
    with pytest.raises(ValueError, match="'nope' is not one of the reward functions"):
        accuracy_function(["numeric_match"], "nope")


def test_accuracy_config_field_is_checked() -> None:
    tiny = ["model.preset=tiny"]
    cfg = load_config(None, [*tiny, 'reward.functions=["numeric_match", "format"]', "reward.accuracy=format"])
    assert cfg.reward.accuracy == "format"
    with pytest.raises(ConfigError, match="reward.accuracy"):
        load_config(None, [*tiny, 'reward.functions=["numeric_match"]', "reward.accuracy=my.py:correct"])
    with pytest.raises(ConfigError, match="reward.max_error_share"):
        load_config(None, [*tiny, "reward.max_error_share=1.5"])
    # Episodes are scored by the environment: there is no reward function to name.
    with pytest.raises(ConfigError, match="environment's verdict"):
        load_config(None, [*tiny, "env.name=calculator", "reward.accuracy=numeric_match"])


def test_format_bonus_is_not_a_correct_answer() -> None:
    """The trust issue's case: [correctness, "format"] where every wrong answer is well formed. The summed reward
    is 1.0 (> 0.5) on every sample; accuracy must be 0."""
    completions = ["17", "\\boxed{15}", "16", "-16"]
    with RewardComputer(["numeric_match", "format"]) as rc:
        res = rc(completions, ["16"] * 4, [EX] * 4)
    assert res.rewards == [1.0, 1.0, 2.0, 1.0]
    assert res.correct == [False, False, True, False]
    # Weights shape the reward, not the verdict: a heavy format weight changes nothing.
    with RewardComputer(["numeric_match", "format"], weights=[0.1, 5.0]) as rc:
        assert rc(completions, ["16"] * 4, [EX] * 4).correct == [False, False, True, False]


# ---------------------------------------------------------------------------------------------------------------
# Non-finite and out-of-range scores, errors with their place, loudness


def test_score_beyond_float32_is_a_named_error(user_dir: Path) -> None:
    for isolation in ("process", "inline"):
        with RewardComputer(["rw.py:huge"], base_dir=user_dir, isolation=isolation) as rc:
            res = rc(["huge", "ok"], ["1", "1"], [EX, EX])
        assert res.per_function["rw.py:huge"] == [0.0, 1.0], isolation
        assert res.num_errors == {"rw.py:huge": 1}, isolation
        assert "1e+300" in res.first_error["rw.py:huge"] and "float32" in res.first_error["rw.py:huge"]
        # What the loop does with the rewards: finite in float32.
        assert torch.isfinite(torch.tensor(res.rewards, dtype=torch.float32)).all()


def test_error_names_the_line_of_the_user_file(user_dir: Path) -> None:
    names = ["rw.py:broken", "rw.py:helper_fails", "rw.py:lib_fails"]
    with RewardComputer(names, base_dir=user_dir) as rc:
        res = rc(["x"], ["1"], [EX])
    where = str((user_dir / "rw.py").resolve())
    assert res.first_error["rw.py:broken"].startswith("ZeroDivisionError: division by zero")
    assert f"{where}:6 in broken" in res.first_error["rw.py:broken"]
    # The deepest frame in the user's file, not the worker's frames in exactrl...
    assert f"{where}:22 in _parse" in res.first_error["rw.py:helper_fails"]
    # ... nor the library's frames below it.
    assert res.first_error["rw.py:lib_fails"].startswith("JSONDecodeError")
    assert f"{where}:27 in lib_fails" in res.first_error["rw.py:lib_fails"]


def test_a_function_failing_past_the_share_is_loud(user_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    names = ["rw.py:huge", "rw.py:always_one"]
    with RewardComputer(names, base_dir=user_dir, max_error_share=0.5) as rc:
        with caplog.at_level(logging.INFO, logger="exactrl.tasks.rewards"):
            rc(["huge", "ok", "ok", "ok"], ["1"] * 4, [EX] * 4)  # 1 of 4 fails: counted, not loud
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert any("'rw.py:huge' failed on 1 of 4" in r.message for r in caplog.records)
            caplog.clear()
            rc(["huge", "huge", "huge", "ok"], ["1"] * 4, [EX] * 4)  # 3 of 4: loud
    loud = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(loud) == 1 and "'rw.py:huge' failed on 3 of 4" in loud[0] and "max_error_share = 0.5" in loud[0]
    )
    assert "1e+300" in loud[0]


def test_timeouts_are_failures_for_the_share_and_the_exit_rule(
    user_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A function that hangs fails as surely as one that raises: its timeouts count toward reward.max_error_share
    (the loud warning) and toward the rule that a run whose correctness function never succeeded exits 3."""
    names = ["rw.py:sleeps", "rw.py:always_one"]
    with RewardComputer(names, base_dir=user_dir, timeout_s=0.2, max_error_share=0.5) as rc:
        with caplog.at_level(logging.INFO, logger="exactrl.tasks.rewards"):
            res = rc(["slow", "ok", "ok", "ok"], ["1"] * 4, [EX] * 4)  # 1 of 4 times out: counted, not loud
            assert res.num_timeouts["rw.py:sleeps"] == 1 and res.num_errors["rw.py:sleeps"] == 0
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert any("'rw.py:sleeps' failed on 1 of 4" in r.message for r in caplog.records)
            caplog.clear()
            rc(["slow", "slow", "slow", "ok"], ["1"] * 4, [EX] * 4)  # 3 of 4: loud
        loud = [r.message for r in caplog.records if r.levelno == logging.WARNING]
        assert len(loud) == 1 and "'rw.py:sleeps' failed on 3 of 4 calls (0 errors, 3 timeouts" in loud[0]
        assert "max_error_share = 0.5" in loud[0]
        assert rc.run_failure() is None  # it succeeded on some calls: often hung, not broken
    with RewardComputer(names, base_dir=user_dir, timeout_s=0.2) as rc:
        rc(["slow", "slow"], ["1", "1"], [EX, EX])
        assert not rc.all_calls_failed()  # always_one worked
        failure = rc.run_failure()
    assert failure is not None and "correctness function 'rw.py:sleeps'" in failure
    assert "every failure a timeout, reward.timeout_s = 0.2" in failure
    # Every call of every function timed out: trained on zeros.
    with RewardComputer(["rw.py:sleeps"], base_dir=user_dir, timeout_s=0.2) as rc:
        rc(["slow"], ["1"], [EX])
        assert rc.all_calls_failed() and "every reward call failed" in (rc.run_failure() or "")


def test_correctness_function_that_never_succeeds_fails_the_run(user_dir: Path) -> None:
    with RewardComputer(["rw.py:broken", "rw.py:always_one"], base_dir=user_dir) as rc:
        assert rc.accuracy_fn == "rw.py:broken"
        res = rc(["1", "2"], ["1", "1"], [EX, EX])
        assert res.rewards == [1.0, 1.0] and res.correct == [False, False]
        assert not rc.all_calls_failed()  # the other function worked: the old verdict let this pass
        failure = rc.run_failure()
    assert failure is not None and "correctness function 'rw.py:broken'" in failure and "rw.py:6" in failure
    # One success of the correctness function is enough: it is not broken, only often wrong.
    with RewardComputer(["rw.py:huge", "rw.py:always_one"], base_dir=user_dir) as rc:
        rc(["huge", "ok"], ["1", "1"], [EX, EX])
        assert rc.run_failure() is None


# ---------------------------------------------------------------------------------------------------------------
# verl's compute_score, as it is

VERL_REWARDS = """\
import asyncio

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert isinstance(extra_info, dict), extra_info
    ok = solution_str.strip() == ground_truth
    bonus = extra_info.get("bonus", 0.0)
    score = (1.0 if ok else 0.0) + bonus + (0.5 if data_source == "gsm8k" else 0.0)
    return {"score": score, "acc": ok, "pred": solution_str}

def two_args(solution_str, ground_truth):
    return float(solution_str == ground_truth)

async def async_score(data_source, solution_str, ground_truth, extra_info):
    await asyncio.sleep(0)
    return 2.0 if solution_str == ground_truth else 0.0

def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
    return [float(s == g) + 10 * len(solution_strs) for s, g in zip(solution_strs, ground_truths)]

def needs_more(data_source, solution_str, ground_truth, tokenizer):
    return 1.0

def no_score_key(data_source, solution_str, ground_truth, extra_info):
    return {"acc": True}
"""


def test_verl_compute_score_works_as_is(tmp_path: Path) -> None:
    (tmp_path / "verl_rewards.py").write_text(VERL_REWARDS)
    records = [
        Example("p", "4", {"data_source": "gsm8k", "extra_info": {"bonus": 0.25}}),
        Example("p", "4", {"data_source": "other"}),  # no extra_info: {} is passed
        Example("p", "4", {}),  # no data_source: None
    ]
    names = [f"verl_rewards.py:{f}" for f in ("compute_score", "two_args", "async_score", "batch_score")]
    for isolation in ("process", "inline"):
        with RewardComputer(names, base_dir=tmp_path, isolation=isolation) as rc:
            res = rc(["4", "4", "5"], ["4", "4", "4"], records)
        assert res.num_errors == dict.fromkeys(names, 0), (isolation, res.first_error)
        assert res.per_function[names[0]] == [1.75, 1.0, 0.0], isolation  # the dict's "score"
        assert res.per_function[names[1]] == [1.0, 1.0, 0.0]
        assert res.per_function[names[2]] == [2.0, 2.0, 0.0]
        assert res.per_function[names[3]] == [31.0, 31.0, 30.0]  # one call with the whole batch
    fn = resolve_reward("verl_rewards.py:compute_score", base_dir=tmp_path)
    assert fn("4", "4", records[0]) == {"score": 1.75, "acc": True, "pred": "4"}
    with pytest.raises(ValueError, match=r"needs_more.*\['tokenizer'\]"):
        resolve_reward("verl_rewards.py:needs_more", base_dir=tmp_path)
    with RewardComputer(["verl_rewards.py:no_score_key"], base_dir=tmp_path, isolation="inline") as rc:
        res = rc(["4"], ["4"], records[:1])
    assert res.num_errors == {"verl_rewards.py:no_score_key": 1}
    assert "without a 'score' key" in res.first_error["verl_rewards.py:no_score_key"]


# ---------------------------------------------------------------------------------------------------------------
# Through the loop: tiny CPU runs of `exactrl train`

RUN_CONFIG = """\
[run]
name = "t"
device = "cpu"
tensorboard = false
report = false
progress = false
output_dir = "out"

[model]
preset = "tiny"
dtype = "float32"

[engine]
block_size = 16
max_num_seqs = 64
max_model_len = 64

[sampling]
max_tokens = 4

[task]
name = "arithmetic"
arithmetic_max_operand = 30
arithmetic_ops = ["+"]
arithmetic_num_terms = 2
use_chat_template = false
num_eval = 4
max_prompt_tokens = 16

[reward]
functions = {functions}

[algorithm]
group_size = 4
rollouts_per_step = 8

[train]
steps = 1
max_tokens_per_microbatch = 1024
save_at_end = false

[sft]
steps = 0
"""


def _train(
    user_dir: Path, functions: list[str], capsys: pytest.CaptureFixture, *sets: str
) -> tuple[int, str, dict, list]:
    from exactrl.cli import main

    config = user_dir / "run.toml"
    config.write_text(RUN_CONFIG.format(functions=json.dumps(functions)))
    out_dir = user_dir / "out"
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster on a shared machine
    cwd = os.getcwd()
    os.chdir(user_dir)  # relative paths in a config (the reward file) resolve from the working directory
    try:
        sets = (f"run.output_dir={out_dir}", *sets)
        code = main(["train", str(config), *[x for s in sets for x in ("--set", s)]])
    finally:
        os.chdir(cwd)
        torch.set_num_threads(torch_threads)
    printed = capsys.readouterr()
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return code, printed.out + printed.err, json.loads((out_dir / "summary.json").read_text()), rows


def test_run_accuracy_counts_the_correctness_function_not_the_reward(
    user_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """Every sample gets reward 1.0 from the second function and is wrong by the first: the old `reward > 0.5`
    reported 100% on every accuracy of the run."""
    code, printed, summary, rows = _train(user_dir, ["rw.py:wrong", "rw.py:always_one"], capsys)
    assert code == 0, printed
    step = next(r for r in rows if "reward/mean" in r)
    assert step["reward/mean"] == 1.0 and step["reward/rw.py:always_one/mean"] == 1.0
    assert step["train/accuracy"] == 0.0
    assert step["reward/rw.py:wrong/errors"] == 0.0 and step["reward/rw.py:always_one/timeouts"] == 0.0
    evals = [r for r in rows if "phase" in r]
    assert [r["eval/accuracy"] for r in evals] == [0.0, 0.0] and all(r["eval/reward"] == 1.0 for r in evals)
    assert summary["accuracy_before_rl"] == 0.0 and summary["accuracy_after_rl"] == 0.0
    assert summary["accuracy_function"] == "rw.py:wrong"
    assert "held-out accuracy 0.0% -> 0.0% (rw.py:wrong > 0.5)" in printed


def test_run_whose_correctness_function_always_fails_exits_non_zero(
    user_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    code, printed, summary, rows = _train(user_dir, ["rw.py:broken", "rw.py:always_one"], capsys)
    assert code == 3, printed
    assert summary["accuracy_function_failed"] and not summary["all_reward_calls_failed"]
    assert "correctness function 'rw.py:broken'" in summary["reward_failure"]
    where = f"{(user_dir / 'rw.py').resolve()}:6 in broken"
    assert "!! every call of the correctness function 'rw.py:broken' failed" in printed
    assert where in summary["reward_failure"] and where in printed  # the step's warning and the summary
    step = next(r for r in rows if "reward/mean" in r)
    assert step["reward/rw.py:broken/errors"] == 8.0 and step["reward/errors"] == 8.0
    assert step["train/accuracy"] == 0.0


def test_run_without_a_correctness_function_reports_no_accuracy(
    user_dir: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="exactrl.tasks.rewards"):
        code, printed, summary, rows = _train(user_dir, ["format"], capsys)
    assert code == 0, printed
    assert [r for r in caplog.records if "accuracy is not reported" in r.message]
    assert "held-out accuracy before RL: n/a (no correctness function) on 4 examples" in printed
    assert summary["accuracy_before_rl"] is None and summary["accuracy_after_rl"] is None
    assert not any("eval/accuracy" in r or "train/accuracy" in r for r in rows)
    assert "held-out accuracy n/a -> n/a (no correctness function" in printed
    assert "| acc - |" in printed


def test_report_names_what_the_accuracy_counts(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from exactrl.report import accuracy_label, report_figure

    assert accuracy_label(tmp_path) == ""  # no summary yet
    for fn, label in [
        ("rw.py:correct", "rw.py:correct > 0.5"),
        ("environment", "episode reward > 0.5"),
        (None, "not reported: no correctness function (reward.accuracy)"),
    ]:
        (tmp_path / "summary.json").write_text(json.dumps({"accuracy_function": fn}))
        assert accuracy_label(tmp_path) == label
    rows = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "reward/mean": 1.0, "train/accuracy": 0.0}]
    fig = report_figure(rows, accuracy_label(tmp_path))
    assert fig.axes[1].get_title().endswith("not reported: no correctness function (reward.accuracy)")


def test_twin_table_says_what_the_accuracy_counts() -> None:
    from exactrl.guard.twin import twin_table

    keys = ["steps", "final_reward", "final_reward_last_tenth", "accuracy_before", "accuracy_after"]
    keys += ["kl_k3_mean", "kl_k3_max", "logprob_abs_diff_max_mean", "logprob_abs_diff_max_max"]
    keys += ["grad_norm_mean", "step_s_mean", "minutes"]
    run = dict.fromkeys(keys, None) | {"label": "exact", "mismatched_tokens": 0, "compared_tokens": 8}
    table = twin_table({"runs": {"exact": run | {"accuracy": "numeric_match > 0.5"}, "fast": run}})
    assert table.endswith("Held-out accuracy: numeric_match > 0.5.")
    assert "Held-out accuracy" not in twin_table({"runs": {"exact": run | {"accuracy": ""}}})


def test_eval_command_accuracy_is_the_correctness_functions(
    user_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    """`exactrl eval --set reward.functions=[...]` with a bonus that every completion earns: the summed reward is
    above 0.5 everywhere (the old accuracy: 1.0), the accuracy is numeric_match's."""
    from exactrl.cli import main

    model = user_dir / "tiny"
    bonus = f"{(user_dir / 'rw.py').resolve()}:always_one"
    argv = ["eval", "--model", str(model), "--task", "arithmetic", "--num", "8", "--max-tokens", "4"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster on a shared machine
    try:
        assert main(["init-model", "--preset", "tiny", "--out", str(model)]) == 0
        capsys.readouterr()
        assert main([*argv, "--json", "--set", f'reward.functions=["{bonus}", "numeric_match"]']) == 0
    finally:
        torch.set_num_threads(threads)
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["eval/reward"] == 1.0 + rec["eval/reward/numeric_match"]
    assert rec["eval/accuracy"] == rec["eval/reward/numeric_match"] < 1.0


def test_run_whose_correctness_function_always_times_out_exits_non_zero(
    user_dir: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """The exit rule above, for a function that hangs instead of raising: every call stopped at reward.timeout_s."""
    sets = ("reward.timeout_s=0.2", "task.num_eval=2")
    with caplog.at_level(logging.INFO, logger="exactrl.tasks.rewards"):
        code, printed, summary, rows = _train(user_dir, ["rw.py:hangs", "rw.py:always_one"], capsys, *sets)
    assert code == 3, printed
    assert summary["accuracy_function_failed"] and not summary["all_reward_calls_failed"]
    assert "correctness function 'rw.py:hangs'" in summary["reward_failure"]
    assert "every failure a timeout, reward.timeout_s = 0.2" in summary["reward_failure"]
    assert "!! every call of the correctness function 'rw.py:hangs' failed" in printed
    loud = [r.message for r in caplog.records if r.levelno == logging.WARNING and "8 of 8" in r.message]
    assert len(loud) == 1  # the training step's (the evaluations score 2 prompts)
    assert "(0 errors, 8 timeouts > 0.2 s), more than reward.max_error_share = 0.5" in loud[0]
    step = next(r for r in rows if "reward/mean" in r)
    assert step["reward/rw.py:hangs/timeouts"] == 8.0 and step["reward/rw.py:hangs/errors"] == 0.0
    assert step["reward/errors"] == 8.0  # the step's failures, timeouts included
