"""Reward functions, plug-in resolution and the guarded RewardComputer (errors, timeouts, bad values)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from exactrl.tasks import BUILTIN_REWARDS, Example, RewardComputer, extract_answer, resolve_reward
from exactrl.tasks.rewards import exact_match, format_reward, numeric_match

EX = Example(prompt="12+7-3=", answer="16", meta={})


@pytest.mark.parametrize(
    "completion",
    [
        "16",
        " 16\n",
        "The answer is 16",
        "The answer is: 16.",
        "\\boxed{16}",
        "so it is \\boxed{16} because 12+7=19",
        "1.6e1",
        "16.0",
        "+16",
        "12+7-3=16",
        "12+7-3 = 19-3 = 16",
        "16\n5+3=8",  # a base model rambling on after its answer
        "#### 16",
        "\\boxed{\\frac{32}{2}}",
        "32/2",
        "16<|im_end|>",
    ],
)
def test_numeric_match_accepts(completion: str) -> None:
    assert numeric_match(completion, "16", EX) == 1.0


@pytest.mark.parametrize(
    "completion",
    ["", "sixteen", "17", "16.001", "-16", "\\boxed{17} and 16", "1e999999999", "The answer is 61"],
)
def test_numeric_match_rejects(completion: str) -> None:
    assert numeric_match(completion, "16", EX) == 0.0


def test_numeric_match_answers() -> None:
    assert numeric_match("x = −4", "-4", EX) == 1.0  # unicode minus
    assert numeric_match("The total is 1,234", "1234", EX) == 1.0
    assert numeric_match("0.3333333", "1/3", EX) == 1.0  # within the 1e-6 tolerance
    assert numeric_match("0.333", "1/3", EX) == 0.0
    assert numeric_match("0.5", "0.5000000001", EX) == 1.0
    # Whole numbers compare exactly: a tolerance would pass a large product that is off by one.
    assert numeric_match("100000000000000000001", "100000000000000000000", EX) == 0.0
    assert numeric_match("12345679", "12345678", EX) == 0.0
    assert numeric_match("1.2345678e7", "12345678", EX) == 1.0
    # A non-numeric answer: compared as text (or by math_verify when that is installed).
    assert numeric_match("\\boxed{x+1}", "x+1", EX) == 1.0
    assert numeric_match("\\boxed{x+2}", "x+1", EX) == 0.0


def test_extract_answer_rule() -> None:
    assert extract_answer("The answer is 16") == "16"
    assert extract_answer("12+7-3=16\n1+1=2") == "16"
    assert extract_answer("first 3 then 4") == "3"
    assert extract_answer("\\boxed{7} 8") == "7"
    assert extract_answer("no digits") is None


def test_exact_match_and_format() -> None:
    assert exact_match(" 16\n", "16", EX) == 1.0
    assert exact_match("16.0", "16", EX) == 0.0
    for good in ["16", " -4 ", "16<|im_end|>", "16</s>", "\\boxed{16}", "2.5\n<|endoftext|>"]:
        assert format_reward(good, "16", EX) == 1.0, good
    for bad in ["The answer is 16", "16 17", "16\n5+3=8", "", "abc", "16<|im_end|>junk"]:
        assert format_reward(bad, "16", EX) == 0.0, bad


def test_resolve_reward_builtins_and_unknown() -> None:
    assert resolve_reward("numeric_match") is numeric_match
    assert set(BUILTIN_REWARDS) == {"exact_match", "numeric_match", "format"}
    with pytest.raises(ValueError, match="exact_match, format, numeric_match"):
        resolve_reward("numeric")


def test_plugin_from_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def length_penalty(completion, answer, example):
                return -0.1 * len(completion)

            NOT_CALLABLE = 3
            """
        )
    )
    (tmp_path / "broken_rewards.py").write_text("import does_not_exist_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward("my_rewards:length_penalty")
    assert fn("abc", "1", EX) == pytest.approx(-0.3)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve_reward("no_such_module:f")
    with pytest.raises(ValueError, match="broken_rewards.*does_not_exist_anywhere"):
        resolve_reward("broken_rewards:f")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_reward("my_rewards:missing")
    with pytest.raises(ValueError, match="not callable"):
        resolve_reward("my_rewards:NOT_CALLABLE")

    with RewardComputer(
        ["numeric_match", "my_rewards:length_penalty"], weights=[1.0, 0.5], timeout_s=1.0
    ) as rc:
        result = rc(["16", "17"], ["16", "16"], [EX, EX])
    assert result.rewards == pytest.approx([1.0 - 0.1, -0.1])
    assert result.per_function["my_rewards:length_penalty"] == pytest.approx([-0.2, -0.2])


def _raises(completion: str, answer: str, example: Example) -> float:
    if completion == "boom":
        raise RuntimeError("kaboom")
    return 1.0


# Long enough that only killing its worker ends the call within the tests' bound; no clock margin involved.
HANG_S = 120.0


def _sleeps(completion: str, answer: str, example: Example) -> float:
    if completion == "slow":
        time.sleep(HANG_S)
    return 1.0


def _bad_values(completion: str, answer: str, example: Example):
    return {"nan": math.nan, "inf": math.inf, "str": "1.0", "none": None, "int": 1, "bool": True}[completion]


def test_raising_function_scores_zero_and_is_counted() -> None:
    with RewardComputer(["numeric_match", _raises], timeout_s=1.0) as rc:
        result = rc(["16", "boom", "16"], ["16"] * 3, [EX] * 3)
    name = _raises.__qualname__
    assert result.per_function[name] == [1.0, 0.0, 1.0]
    assert result.num_errors == {"numeric_match": 0, name: 1}
    assert result.num_timeouts == {"numeric_match": 0, name: 0}
    assert "kaboom" in result.first_error[name]
    assert result.rewards == [2.0, 0.0, 2.0]  # "boom" is also not 16


def test_sleeping_function_times_out_and_run_goes_on() -> None:
    """Hung calls are killed (not waited for, not abandoned), score 0, count as timeouts, and the computer keeps
    working. The hang lasts HANG_S: the bound below is generous (many times the 3 x 0.2 s of timeouts, for a loaded
    machine) and still far below what one call left running would take."""
    rc = RewardComputer([_sleeps, "format"], timeout_s=0.2, max_workers=2)
    completions = ["slow", "16", "slow", "16", "slow", "x"]
    start = time.monotonic()
    result = rc(completions, ["16"] * 6, [EX] * 6)
    elapsed = time.monotonic() - start
    assert elapsed < HANG_S / 4, elapsed
    name = _sleeps.__qualname__
    assert result.per_function[name] == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert result.num_timeouts[name] == 3 and result.num_errors[name] == 0
    assert result.per_function["format"] == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    # One worker killed per hung call, none left behind: the pool holds at most its two workers.
    assert rc.num_killed_workers == 3
    assert rc._pool is not None and rc._pool.num_workers <= 2
    # The computer still works after killing workers, and a later hung call is handled the same way.
    assert rc(["16"], ["16"], [EX]).rewards == [2.0]
    again = rc(["slow", "16"], ["16"] * 2, [EX] * 2)
    assert again.per_function[name] == [0.0, 1.0] and again.num_timeouts[name] == 1
    assert rc.num_killed_workers == 4
    rc.close()


def test_non_numeric_and_non_finite_returns_are_errors() -> None:
    keys = ["nan", "inf", "str", "none", "int", "bool"]
    with RewardComputer([_bad_values], timeout_s=1.0) as rc:
        result = rc(keys, ["1"] * 6, [EX] * 6)
    name = _bad_values.__qualname__
    assert result.per_function[name] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert result.num_errors[name] == 4


def test_computer_argument_checks() -> None:
    with pytest.raises(ValueError, match="weights"):
        RewardComputer(["format"], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="more than once"):
        RewardComputer(["format", "format"])
    with pytest.raises(ValueError, match="timeout_s"):
        RewardComputer(["format"], timeout_s=0)
    with pytest.raises(ValueError, match="built-ins"):
        RewardComputer(["nope"])
    with RewardComputer(["format"]) as rc, pytest.raises(ValueError, match="2 completions"):
        rc(["1", "2"], ["1"], [EX])


def test_hung_function_does_not_block_interpreter_exit(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(
        "import threading\n\ndef hang(completion, answer, example):\n    threading.Event().wait()\n"
    )
    script = textwrap.dedent(
        """
        from exactrl.tasks import Example, RewardComputer

        rc = RewardComputer(["hang.py:hang"], timeout_s=0.2)
        result = rc(["a", "b"], ["1", "1"], [Example("p", "1", {})] * 2)
        assert result.num_timeouts == {"hang.py:hang": 2}, result
        print("done")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
