"""Reward plug-ins as the README shows them: files next to the config, module names, batched and async functions,
worker processes that are killed on timeout, and the "every call failed" verdict."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from exactrl.tasks import Example, RewardComputer, resolve_reward

EX = Example(prompt="2+2=", answer="4", meta={"source": "t"})

REWARD_FILE = """
import asyncio
import os
import textwrap

def length(completion, answer, example):
    return float(len(completion))

def matches(completion, answer, example):
    return 1.0 if completion.strip() == answer else 0.0

def batch_len(completions, answers, examples):
    assert isinstance(completions, list) and isinstance(examples, list)
    return [float(len(c)) + 100 * len(completions) for c in completions]
batch_len.batched = True

def wrong_count(completions, answers, examples):
    return [1.0]
wrong_count.batched = True

async def slow_match(completion, answer, example):
    await asyncio.sleep(1.0)  # concurrent: 8 calls must not take 8 x 1 s
    return 1.0 if completion.strip() == answer else 0.0

async def async_batch(completions, answers, examples):
    return [2.0 for _ in completions]
async_batch.batched = True

async def async_hang(completion, answer, example):
    if completion == "hang":
        await asyncio.sleep(60)
    return 1.0

def busy(completion, answer, example):
    if completion == "spin":
        while True:  # a busy loop: no thread could stop this
            pass
    return 1.0

def pid(completion, answer, example):
    return float(os.getpid())

def die(completion, answer, example):
    if completion == "die":
        os._exit(3)
    return 1.0

def always_raises(completion, answer, example):
    raise ValueError("no parse")
"""


@pytest.fixture()
def plugin_dir(tmp_path: Path) -> Path:
    """A config directory with a reward file and a module, neither on sys.path nor in the cwd."""
    d = tmp_path / "project"
    (d / "rewards").mkdir(parents=True)
    (d / "rewards" / "myrewards.py").write_text(REWARD_FILE)
    (d / "mymod.py").write_text("def one(completion, answer, example):\n    return 1.0\n")
    return d


def test_file_and_module_specs_resolve_against_the_config_dir(
    plugin_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # not the config's directory
    with pytest.raises(ValueError, match="not found"):
        resolve_reward("rewards/myrewards.py:length")
    fn = resolve_reward("rewards/myrewards.py:length", base_dir=plugin_dir)
    assert fn("abc", "4", EX) == 3.0
    assert resolve_reward("mymod:one", base_dir=plugin_dir)("x", "4", EX) == 1.0
    with RewardComputer(
        ["rewards/myrewards.py:length", "mymod:one", "exact_match"], timeout_s=5, base_dir=plugin_dir
    ) as rc:
        res = rc(["4", "abc"], ["4", "4"], [EX, EX])
    assert res.per_function["rewards/myrewards.py:length"] == [1.0, 3.0]
    assert res.per_function["mymod:one"] == [1.0, 1.0]
    assert res.rewards == [3.0, 4.0]


def test_relative_file_falls_back_to_the_cwd(plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(plugin_dir)
    with RewardComputer(["rewards/myrewards.py:matches"], base_dir=plugin_dir / "elsewhere") as rc:
        assert rc(["4", "5"], ["4", "4"], [EX, EX]).rewards == [1.0, 0.0]


def test_bad_plugins_fail_at_start_naming_the_file(plugin_dir: Path) -> None:
    (plugin_dir / "broken.py").write_text("import does_not_exist_anywhere\n")
    with pytest.raises(ValueError, match=r"broken\.py.*does_not_exist_anywhere"):
        RewardComputer(["broken.py:f"], base_dir=plugin_dir)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        RewardComputer(["rewards/myrewards.py:nope"], base_dir=plugin_dir)
    with pytest.raises(ValueError, match="cannot be sent to a worker process"):
        RewardComputer([lambda c, a, e: 1.0])
    with RewardComputer([lambda c, a, e: 1.0], isolation="inline") as rc:  # in this thread, no timeout
        assert rc(["x"], ["4"], [EX]).rewards == [1.0]


def test_batched_and_async_functions(plugin_dir: Path) -> None:
    names = [
        "rewards/myrewards.py:batch_len",
        "rewards/myrewards.py:wrong_count",
        "rewards/myrewards.py:slow_match",
        "rewards/myrewards.py:async_batch",
    ]
    with RewardComputer(names, timeout_s=5, base_dir=plugin_dir, max_workers=2) as rc:
        n = 8
        completions = ["4" if i % 2 else "x" * i for i in range(n)]
        start = time.monotonic()
        res = rc(completions, ["4"] * n, [EX] * n)
        elapsed = time.monotonic() - start
    # One call with all 8 samples: 100 * 8 added to each length proves it saw the whole list.
    assert res.per_function[names[0]] == [800.0 + len(c) for c in completions]
    assert res.per_function[names[1]] == [0.0] * n and res.num_errors[names[1]] == n
    assert "1 scores for 8 samples" in res.first_error[names[1]]
    assert res.per_function[names[2]] == [float(i % 2) for i in range(n)]
    assert res.per_function[names[3]] == [2.0] * n
    # Sequential awaits would take 8 s (4 per worker), concurrent ones about 1 s: a wide gap, for a loaded machine.
    assert elapsed < 5.0, elapsed


def test_busy_loop_is_killed_within_the_timeout(plugin_dir: Path) -> None:
    timeout = 0.5
    with RewardComputer(
        ["rewards/myrewards.py:busy", "rewards/myrewards.py:pid"],
        timeout_s=timeout,
        base_dir=plugin_dir,
        max_workers=1,
    ) as rc:
        before = rc(["ok"], ["4"], [EX]).per_function["rewards/myrewards.py:pid"][0]
        completions = ["ok"] * 8
        completions[5] = "spin"  # the second call of a chunk of two: its chunk-mate must still be scored
        start = time.monotonic()
        res = rc(completions, ["4"] * 8, [EX] * 8)
        elapsed = time.monotonic() - start
        assert elapsed < 30.0, elapsed  # the loop never ends: only a kill returns at all (generous for load)
        assert res.per_function["rewards/myrewards.py:busy"] == [1.0] * 5 + [0.0] + [1.0] * 2
        assert (
            res.num_timeouts["rewards/myrewards.py:busy"] == 1
            and res.num_errors["rewards/myrewards.py:busy"] == 0
        )
        after = res.per_function["rewards/myrewards.py:pid"]
        assert rc.num_killed_workers == 1
        # The spinning worker is gone (killed, not abandoned) and a fresh one answered the calls after it.
        assert len(set(after)) == 1 and after[0] != before
        with pytest.raises(ProcessLookupError):
            os.kill(int(before), 0)


def test_async_hang_and_worker_death_are_counted(plugin_dir: Path) -> None:
    names = ["rewards/myrewards.py:async_hang", "rewards/myrewards.py:die"]
    with RewardComputer(names, timeout_s=0.3, base_dir=plugin_dir, max_workers=1) as rc:
        start = time.monotonic()
        res = rc(["hang", "ok", "die", "ok"], ["4"] * 4, [EX] * 4)
        assert time.monotonic() - start < 30.0  # the hang is 60 s: cancelled at 0.3 s (generous for load)
        assert res.per_function[names[0]] == [0.0, 1.0, 1.0, 1.0] and res.num_timeouts[names[0]] == 1
        assert res.per_function[names[1]] == [1.0, 1.0, 0.0, 1.0] and res.num_errors[names[1]] == 1
        assert "exit code 3" in res.first_error[names[1]]
        assert rc(["ok"], ["4"], [EX]).rewards == [2.0]


def test_every_call_failed(plugin_dir: Path) -> None:
    with RewardComputer(["rewards/myrewards.py:always_raises"], base_dir=plugin_dir) as rc:
        rc(["1", "2"], ["4", "4"], [EX, EX])
        rc(["3"], ["4"], [EX])
        assert rc.all_calls_failed()
        summary = rc.failure_summary()
        assert summary is not None and "every reward call failed" in summary and "3 calls" in summary
    with RewardComputer(["rewards/myrewards.py:always_raises", "exact_match"], base_dir=plugin_dir) as rc:
        rc(["1"], ["4"], [EX])
        assert not rc.all_calls_failed()  # exact_match worked
        assert "every call failed for" in (rc.failure_summary() or "")
    with RewardComputer(["exact_match"]) as rc:
        assert not rc.all_calls_failed()  # no calls yet
        rc(["4"], ["4"], [EX])
        assert not rc.all_calls_failed() and rc.failure_summary() is None


def test_readme_signature_example(tmp_path: Path) -> None:
    """The reward file of the README's "Bring your own data and reward" section, as written there."""
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Bring your own data and reward") :]
    code = section[
        section.index("```python") + len("```python") : section.index("```", section.index("```python") + 3)
    ]
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(code))
    ex = Example(prompt="What is 2+2?", answer="4", meta={})
    with RewardComputer(["my_rewards.py:correct"], base_dir=tmp_path) as rc:
        assert rc(["The answer is 4.", "5"], ["4", "4"], [ex, ex]).rewards == [1.0, 0.0]


def test_readme_record_loads_with_the_readme_config(tmp_path: Path) -> None:
    import json

    from exactrl.config import tomllib  # the stdlib's, or the tomli backport on Python 3.10
    from exactrl.tasks import make_task

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Bring your own data and reward") :]

    def block(lang: str) -> str:
        start = section.index(f"```{lang}\n") + len(lang) + 4
        return section[start : section.index("```", start)]

    record = json.loads(block("json"))
    task_cfg = tomllib.loads(block("toml"))["task"]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps(record | {"data_source": "again"}) + "\n")
    task = make_task("jsonl", path=path, answer_field=task_cfg["answer_field"], num_eval=0)
    ex = next(task.train_examples())
    assert ex.answer == "4" and ex.prompt == record["prompt"] and task.num_skipped == 0
