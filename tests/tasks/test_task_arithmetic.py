"""ArithmeticTask: correct answers, a disjoint held-out set, determinism and resume."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from exactrl.tasks import ArithmeticTask, Task, make_task
from exactrl.tasks.arithmetic import evaluate

_PROMPT_RE = re.compile(r"^(\d+(?:[-+*]\d+)+)=$")


def _left_to_right(prompt: str) -> int:
    """Independent check for +/- prompts: tokenise and fold with int arithmetic (no eval of strings)."""
    tokens = re.findall(r"\d+|[-+]", prompt.rstrip("="))
    value = int(tokens[0])
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        value = value + int(operand) if op == "+" else value - int(operand)
    return value


def _take(task: ArithmeticTask, n: int, seed: int | None = None) -> list:
    return list(itertools.islice(task.train_examples(seed), n))


@pytest.mark.parametrize("num_terms", [2, 3, 4])
def test_answers_are_correct_and_prompts_compact(num_terms: int) -> None:
    task = ArithmeticTask(max_operand=50, num_terms=num_terms)
    for ex in _take(task, 300) + task.eval_examples(50):
        assert _PROMPT_RE.match(ex.prompt), ex.prompt  # no prose, no spaces
        assert int(ex.answer) == _left_to_right(ex.prompt)
        assert len(ex.meta["operands"]) == num_terms
        assert all(0 <= x <= 50 for x in ex.meta["operands"])


def test_multiplication_precedence() -> None:
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4], ["*", "-"]) == 2
    assert evaluate([5, 2, 3, 2], ["-", "*", "*"]) == -7
    task = ArithmeticTask(max_operand=9, ops=("+", "-", "*"), num_terms=3)
    for ex in _take(task, 200):
        a, b, c = ex.meta["operands"]
        op1, op2 = ex.meta["ops"]
        # Precedence spelled out by hand, independently of `evaluate`.
        apply = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
        expected = apply[op1](a, b * c) if op2 == "*" and op1 != "*" else apply[op2](apply[op1](a, b), c)
        assert int(ex.answer) == expected, ex.prompt


def test_train_and_eval_are_disjoint() -> None:
    task = ArithmeticTask()  # the default space is small (882 expressions), so overlap would show
    eval_prompts = {ex.prompt for ex in task.eval_examples()}
    assert len(eval_prompts) == len(task.eval_examples()) > 50
    for seed in range(3):
        train_prompts = {ex.prompt for ex in _take(task, 2000, seed=seed)}
        assert not train_prompts & eval_prompts
        assert len(train_prompts) > 700  # the train stream covers the rest of the space


def test_eval_set_is_fixed_and_prefix_stable() -> None:
    a = ArithmeticTask(seed=0).eval_examples(50)
    b = ArithmeticTask(seed=123).eval_examples(80)
    assert [e.prompt for e in a] == [e.prompt for e in b[:50]]
    big = ArithmeticTask(max_operand=999, num_terms=3)  # sampled rather than enumerated
    first = big.eval_examples(20)
    assert [e.prompt for e in first] == [e.prompt for e in big.eval_examples(60)[:20]]
    assert len({e.prompt for e in big.eval_examples(60)}) == 60


def test_eval_request_beyond_space_warns() -> None:
    task = ArithmeticTask(max_operand=5)
    with pytest.warns(UserWarning, match="held-out expressions"):
        out = task.eval_examples(1000)
    assert 0 < len(out) < 1000


def test_determinism_and_seeds() -> None:
    a = [e.prompt for e in _take(ArithmeticTask(seed=7), 100)]
    b = [e.prompt for e in _take(ArithmeticTask(seed=7), 100)]
    c = [e.prompt for e in _take(ArithmeticTask(seed=8), 100)]
    assert a == b
    assert a != c
    assert [e.prompt for e in _take(ArithmeticTask(seed=0), 100, seed=7)] == a


def test_state_dict_resume() -> None:
    task = ArithmeticTask(seed=3)
    it = task.train_examples()
    head = [next(it) for _ in range(37)]
    state = json.loads(json.dumps(task.state_dict()))  # must survive a JSON round trip
    tail = [next(it) for _ in range(25)]

    resumed = ArithmeticTask(seed=3)
    resumed.load_state_dict(state)
    assert [e.prompt for e in _take(resumed, 25, seed=3)] == [e.prompt for e in tail]
    assert state["position"] == len(head)

    # Loading into a live iterator takes effect on its next step.
    task.load_state_dict(state)
    assert next(it).prompt == tail[0].prompt


def test_state_from_other_settings_is_refused() -> None:
    state = ArithmeticTask(max_operand=20).state_dict()
    with pytest.raises(ValueError, match="settings"):
        ArithmeticTask(max_operand=30).load_state_dict(state)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError, match="num_terms"):
        ArithmeticTask(num_terms=1)
    with pytest.raises(ValueError, match="eval bucket|eval_fraction"):
        ArithmeticTask(max_operand=0, ops=("+",), eval_fraction=0.999999)


def test_protocol_and_factory() -> None:
    task = make_task("arithmetic", max_operand=9)
    assert isinstance(task, Task)
    with pytest.raises(ValueError, match="arithmetic, jsonl"):
        make_task("nope")
