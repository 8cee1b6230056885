"""A calculator tool: the model writes `<calc>12*7</calc>`, the environment answers `<result>84</result>` and the
episode goes on; a turn without a call is the final answer, scored against the example's answer.

The expression is parsed, never evaluated as Python: integers and decimals, + - * /, unary minus and
parentheses, with a cap on length, nesting and the size of numbers (a model can write `9**9**9`-style bombs; it
gets an error result instead). Division is exact (`7/2` gives `3.5`, `1/3` a 12-digit decimal).
"""

from __future__ import annotations

import ast
import re
import zlib
from fractions import Fraction
from typing import ClassVar

from exactrl.envs.base import Demonstration, Environment, StepResult, Turn
from exactrl.tasks.base import Example
from exactrl.tasks.reward_fns import format_reward, numeric_match

_CALL_RE = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_MAX_EXPR_CHARS = 200
_MAX_DIGITS = 60  # any intermediate value beyond this many digits is refused


class CalcError(ValueError):
    """The expression is not one the calculator accepts (the message says why)."""


def calculate(expr: str) -> Fraction:
    """The exact value of an arithmetic expression (see the module docstring); CalcError if not accepted."""
    if len(expr) > _MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {_MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise CalcError("not an arithmetic expression") from None

    def ev(node: ast.AST, depth: int) -> Fraction:
        if depth > 50:
            raise CalcError("expression nested too deeply")
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand, depth + 1)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            a, b = ev(node.left, depth + 1), ev(node.right, depth + 1)
            if isinstance(node.op, ast.Div):
                if b == 0:
                    raise CalcError("division by zero")
                v = a / b
            else:
                v = (
                    a + b
                    if isinstance(node.op, ast.Add)
                    else a - b
                    if isinstance(node.op, ast.Sub)
                    else a * b
                )
            if len(str(abs(v.numerator))) > _MAX_DIGITS or len(str(v.denominator)) > _MAX_DIGITS:
                raise CalcError("number too large")
            return v
        raise CalcError(f"unsupported element {type(node).__name__}")

    return ev(tree.body, 0)


def format_number(v: Fraction) -> str:
    """An integer as itself, anything else as a decimal of at most 12 places (trailing zeros dropped)."""
    if v.denominator == 1:
        return str(v.numerator)
    sign = "-" if v < 0 else ""
    scaled = round(abs(v) * 10**12)
    whole, frac = divmod(scaled, 10**12)
    return f"{sign}{whole}.{frac:012d}".rstrip("0").rstrip(".")


class CalculatorEnv(Environment):
    """Tool calls until the model answers. The episode's reward: 1.0 for a final answer equal to the example's
    answer (`numeric_match`), else 0.0 (also when the episode is stopped at a limit before an answer); then
    `call_cost` is taken off per tool call and `format_penalty` when the final turn is more than a number
    (`format_reward`), so the reward depends on the whole episode. Both are 0 by default ([env] options).
    `demo_call_share`: the share of problems whose worked episode (`demonstration`, the SFT warm start) calls
    the calculator; the others answer directly, as a model trained on data from several sources would. 1.0
    (the default) calls on every problem."""

    stop: ClassVar[list[str]] = ["</calc>"]

    def __init__(
        self, call_cost: float = 0.0, format_penalty: float = 0.0, demo_call_share: float = 1.0
    ) -> None:
        for name, v in (
            ("call_cost", call_cost),
            ("format_penalty", format_penalty),
            ("demo_call_share", demo_call_share),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"calculator: {name} must be a number in [0, 1], got {v!r}")
        self.call_cost, self.format_penalty = float(call_cost), float(format_penalty)
        self.demo_call_share = float(demo_call_share)
        self.calls = 0

    def reset(self, example: Example) -> None:
        self.example = example
        self.calls = 0

    def step(self, turn: Turn) -> StepResult:
        calls = _CALL_RE.findall(turn.text)
        if not calls:
            reward = numeric_match(turn.text, self.example.answer, self.example)
            reward -= self.call_cost * self.calls
            if self.format_penalty and not format_reward(turn.text, self.example.answer, self.example):
                reward -= self.format_penalty
            return StepResult(done=True, reward=reward)
        self.calls += 1
        try:  # the turn ends at the first "</calc>", so the last call is the one just made
            result, errors = format_number(calculate(calls[-1])), 0
        except CalcError as e:
            result, errors = f"error: {e}", 1
        return StepResult(observation=f"<result>{result}</result>", tool_calls=1, tool_errors=errors)

    def demonstration(self, example: Example) -> Demonstration:
        """One call with the problem's expression, its result, then the answer. The expression is
        `example.meta["expression"]`, or the prompt itself when it is one followed by "=" (the arithmetic
        task's "47*23="); a prompt that is neither is refused by name. With `demo_call_share` below 1, a
        problem outside that share (decided by a checksum of its prompt, so the same problem always gets the
        same episode) is answered directly, with no call."""
        if self.demo_call_share < 1.0:
            bucket = zlib.crc32(str(example.prompt).encode("utf-8")) / 2**32
            if bucket >= self.demo_call_share:
                return [(example.answer, True)]
        expr = example.meta.get("expression")
        if expr is None and isinstance(example.prompt, str) and example.prompt.rstrip().endswith("="):
            expr = example.prompt.rstrip()[:-1]
        where = example.meta.get("_source", "")
        try:
            value = calculate(str(expr)) if expr is not None else None
        except CalcError:
            value = None
        if value is None:
            raise ValueError(
                f"calculator: no demonstration for the example {where or repr(example.prompt)[:60]}: its prompt is "
                'not an arithmetic expression followed by "=" and it has no "expression" field'
            )
        result = format_number(value)
        return [(f"<calc>{expr}</calc>", True), (f"<result>{result}</result>", False), (example.answer, True)]
