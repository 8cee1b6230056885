"""Reward functions: the built-ins, and the names a config gives them (`resolve_reward`).

A reward function is `fn(completion: str, answer: str, example: Example) -> float`; `example.prompt` is the prompt
and `example.meta` the record's other fields. A function with the attribute `batched = True` is called once per
batch instead: `fn(completions: list[str], answers: list[str], examples: list[Example]) -> list[float]`. Either kind
may be `async def`. Built-ins live in the plain dict `BUILTIN_REWARDS`; anything else is named as
`"path/to/file.py:function"` or `"module:function"` (`resolve_reward`).

Built-ins:
  * `exact_match`: 1.0 iff `completion.strip() == answer.strip()`.
  * `numeric_match`: 1.0 iff the completion's final number (`extract_answer`, rule below) equals the numeric answer:
    exactly when both are whole numbers, else within a relative tolerance of 1e-6 (absolute below 1). Numbers may have a sign, a decimal part, an exponent
    (`1.6e1`), thousands commas (`1,234`) or be a fraction `a/b`. For an answer that is not a number, the
    `math_verify` package is used when it is installed; otherwise the completion (or its `\\boxed{}` content) must
    equal the answer after whitespace and `$` are trimmed. Model output is only ever parsed, never evaluated.
  * `format`: 1.0 iff the completion is just one number, optionally wrapped in `\\boxed{}`, with optional
    surrounding whitespace and optional trailing end-of-text markers (`<|...|>`, `</s>`, `<eos>`): the answer
    format of the arithmetic task.

Which number is "the final number" (first rule that applies wins):
  1. the content of the last `\\boxed{...}` (or `\\fbox{...}`); rules 2-5 are then applied to that content only;
  2. the number after the last `####` (GSM8K style);
  3. the number after the last "answer is" / "answer:" (case-insensitive);
  4. the number right after the last `=` of the first non-empty line (a restated `12+7-3=16`, `x = 19-3 = 16`);
  5. otherwise the first number of the completion.
  Rules 4 and 5 look at the start of the completion on purpose: a small base model answering `12+7-3=` often
  rambles on with new `a+b=c` lines after its answer, and those later numbers are not its answer.
  LaTeX fractions `\\frac{a}{b}` (also `\\dfrac`, `\\tfrac`) with numeric parts are read as `a/b`.

A function with verl's signature, `compute_score(data_source, solution_str, ground_truth, extra_info)`, works as it
is (`exactrl.tasks.verl_score`); any function may return a dict `{"score": s, ...}`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import re
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from exactrl.tasks import verl_score
from exactrl.tasks.base import Example

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str, Example], float]

# ---------------------------------------------------------------------------------------------------------------
# Number extraction

# A number: sign, digits (plain or with thousands commas), optional decimals, optional exponent; optionally
# followed by `/digits` (a fraction). The exponent needs digits, so "2 eggs" and "2e" read as 2.
_NUM = (
    r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
    r"(?:/\d+(?![.\d]))?"  # fraction denominator: integers only, so "1/2.5" is not half-parsed
)
_NUM_RE = re.compile(_NUM)
# One unbounded run between a keyword and its number, never two adjacent ones (`\s*\$?\s*`): adjacent runs
# backtrack polynomially on a long stretch of spaces with no number after it.
_FULL_NUM_RE = re.compile(rf"\s*({_NUM})\s*")
_GSM8K_RE = re.compile(rf"####[\s$]*({_NUM})")
_ANSWER_IS_RE = re.compile(rf"answer(?:\s+is)?[\s:=$*(\\]*({_NUM})", re.IGNORECASE)
_AFTER_EQ_RE = re.compile(rf"=[\s$]*({_NUM})")
# Anchored at the end and starting with "<", so a search fails fast at every other position (linear time).
_END_MARKER_RE = re.compile(r"(?:<\|[^|<>\s]{1,40}\|>|</s>|<eos>)\Z")
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\{\s*([-+]?\d+)\s*\}\{\s*(\d+)\s*\}")
_BOXED_FORMAT_RE = re.compile(rf"\s*\\boxed\{{\s*({_NUM})\s*\}}\s*")
# Guards against hostile inputs such as "1e999999999" (exact arithmetic would build a billion-digit integer).
_MAX_NUMBER_CHARS = 200
_MAX_EXPONENT = 1000
_REL_TOL = Fraction(1, 10**6)

_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}`, braces balanced; None if absent or unclosed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _last_match(pattern: re.Pattern[str], text: str) -> str | None:
    last = None
    for last in pattern.finditer(text):  # noqa: B007 - we want the last match
        pass
    return last.group(1) if last is not None else None


def _number_in(text: str) -> str | None:
    """Rules 2-5 of the module docstring on `text`."""
    for pattern in (_GSM8K_RE, _ANSWER_IS_RE):
        found = _last_match(pattern, text)
        if found is not None:
            return found
    stripped = text.lstrip()
    first_line = stripped[: stripped.find("\n")] if "\n" in stripped else stripped
    found = _last_match(_AFTER_EQ_RE, first_line)
    if found is not None:
        return found
    first = _NUM_RE.search(text)
    return first.group(0) if first else None


def extract_answer(completion: str) -> str | None:
    """The text of the completion's final number (see the module docstring for the rule), or None."""
    text = _LATEX_FRAC_RE.sub(r"\1/\2", completion.translate(_MINUS_SIGNS))
    boxed = _last_boxed(text)
    return _number_in(boxed if boxed is not None else text)


def parse_number(text: str) -> Fraction | None:
    """`text` (a whole string, surrounding whitespace allowed) as an exact number, or None if it is not one."""
    match = _FULL_NUM_RE.fullmatch(text.translate(_MINUS_SIGNS))
    return _to_fraction(match.group(1)) if match else None


def _to_fraction(token: str) -> Fraction | None:
    if len(token) > _MAX_NUMBER_CHARS:
        return None
    numerator, _, denominator = token.replace(",", "").partition("/")
    mantissa, _, exponent = numerator.lower().partition("e")
    if exponent and abs(int(exponent)) > _MAX_EXPONENT:
        return None
    if mantissa.endswith("."):
        mantissa = mantissa[:-1]
    try:
        power = int(exponent or 0)
        scale = Fraction(10 ** abs(power))  # exact either way: no float in between
        value = Fraction(mantissa) * scale if power >= 0 else Fraction(mantissa) / scale
    except (ValueError, ZeroDivisionError):
        return None
    if denominator:
        if int(denominator) == 0:
            return None
        value /= int(denominator)
    return value


def numbers_match(x: Fraction, y: Fraction) -> bool:
    """Exactly equal if both are whole numbers (so a large product that is off by one does not pass); otherwise
    within a relative tolerance of 1e-6 of `y` (absolute 1e-6 when |y| < 1), for rounded decimals like 0.333333."""
    if x.denominator == 1 and y.denominator == 1:
        return x == y
    return abs(x - y) <= _REL_TOL * max(Fraction(1), abs(y))


# ---------------------------------------------------------------------------------------------------------------
# Built-in reward functions


def exact_match(completion: str, answer: str, example: Example) -> float:
    """1.0 iff the completion equals the answer after stripping surrounding whitespace."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def numeric_match(completion: str, answer: str, example: Example) -> float:
    """1.0 iff the completion's final number equals the answer (see the module docstring)."""
    target = parse_number(answer)
    if target is not None:
        token = extract_answer(completion)
        if token is None:
            return 0.0
        value = _to_fraction(token)
        return 1.0 if value is not None and numbers_match(value, target) else 0.0
    verified = _math_verify(completion, answer)
    if verified is not None:
        return verified
    boxed = _last_boxed(completion)
    candidate = boxed if boxed is not None else completion
    return 1.0 if _normalise_text(candidate) == _normalise_text(answer) else 0.0


def _normalise_text(text: str) -> str:
    return " ".join(text.strip().strip("$").split())


def _math_verify(completion: str, answer: str) -> float | None:
    """Symbolic comparison with `math_verify` if it is installed (an optional extra), else None."""
    try:
        import math_verify
    except ImportError:
        return None
    # math_verify's own timeouts use SIGALRM, which only works in the main thread; we run in a worker thread and
    # the RewardComputer timeout bounds the call instead, so turn them off where the installed version allows.
    try:
        gold = math_verify.parse(f"${answer}$", parsing_timeout=None)
        pred = math_verify.parse(completion, parsing_timeout=None)
        return 1.0 if math_verify.verify(gold, pred, timeout_seconds=None) else 0.0
    except TypeError:
        gold = math_verify.parse(f"${answer}$")
        pred = math_verify.parse(completion)
        return 1.0 if math_verify.verify(gold, pred) else 0.0


def format_reward(completion: str, answer: str, example: Example) -> float:
    """1.0 iff the completion is just a number (or `\\boxed{number}`), allowing whitespace and end markers."""
    text = completion.translate(_MINUS_SIGNS).strip()
    while (marker := _END_MARKER_RE.search(text)) is not None:
        text = text[: marker.start()].rstrip()
    if _FULL_NUM_RE.fullmatch(text) or _BOXED_FORMAT_RE.fullmatch(text):
        return 1.0
    return 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "format": format_reward,
}

# ---------------------------------------------------------------------------------------------------------------
# Accuracy: which function's verdict says "correct"

# The built-ins that judge the answer, and those that only shape the reward: what `accuracy_function` picks from.
CORRECTNESS_REWARDS = ("numeric_match", "exact_match")
SHAPING_REWARDS = ("format",)
# A sample is correct when the correctness function scores it above this, unweighted (reward.weights shape the
# reward, not the verdict). 1 vs 0, 1 vs -1 and full vs partial credit (a 0.1 for a well-formed wrong answer) all
# split here; "equal to the function's maximum" would need a maximum that a user function does not declare.
CORRECT_ABOVE = 0.5


def accuracy_function(names: Sequence[str], accuracy: str = "auto") -> str | None:
    """Which of the reward functions `names` is the correctness verdict that accuracy counts, or None.

    accuracy: a name from `names`; "off" (no accuracy); or "auto": the one built-in correctness function
    (`CORRECTNESS_REWARDS`) if exactly one is listed, else the first function that is not a known shaping reward
    (`SHAPING_REWARDS`), else None (accuracy is not reported rather than read off a shaping reward)."""
    if accuracy == "off":
        return None
    if accuracy != "auto":
        if accuracy not in names:
            raise ValueError(
                f"reward.accuracy = {accuracy!r} is not one of the reward functions {list(names)}; name one of "
                'them exactly as listed, "auto" or "off"'
            )
        return accuracy
    builtins = [n for n in names if n in CORRECTNESS_REWARDS]
    if len(builtins) == 1:
        return builtins[0]
    return next((n for n in names if n not in SHAPING_REWARDS), None)


def no_accuracy_notice(names: Sequence[str]) -> str:
    """The one line said when no correctness function can be identified."""
    return (
        f"reward: none of {list(names)} is a correctness function (built-ins: {', '.join(CORRECTNESS_REWARDS)}; "
        f"{', '.join(SHAPING_REWARDS)} only shapes the reward): accuracy is not reported; set reward.accuracy to "
        f"the function whose score > {CORRECT_ABOVE:g} means a correct answer"
    )


def _plugin_search_dirs(base_dir: str | Path | None) -> list[Path]:
    """Where relative reward file paths and plug-in modules are looked up: the config's directory, then the cwd."""
    dirs = [Path(base_dir).resolve()] if base_dir is not None else []
    cwd = Path.cwd().resolve()
    return dirs + ([cwd] if cwd not in dirs else [])


def _load_file_module(module_path: str, name: str, base_dir: str | Path | None) -> Any:
    path = Path(module_path).expanduser()
    candidates = [path] if path.is_absolute() else [d / path for d in _plugin_search_dirs(base_dir)]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        tried = ", ".join(str(c) for c in candidates)
        raise ValueError(f"reward plug-in {name!r}: file {module_path!r} not found (looked for {tried})")
    found = found.resolve()
    # One module per file, under a name that cannot collide with an importable package; registered in
    # sys.modules so that the file's own dataclasses and pickling by reference work.
    module_name = f"_exactrl_reward_{found.stem}_{hashlib.sha1(str(found).encode()).hexdigest()[:10]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, found)
    if spec is None or spec.loader is None:
        raise ValueError(f"reward plug-in {name!r}: cannot load {found} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    # The file may import helpers that sit next to it.
    if str(found.parent) not in sys.path:
        sys.path.insert(0, str(found.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # a plug-in may fail to import in any way; report which file and why
        del sys.modules[module_name]
        raise ValueError(f"reward plug-in {name!r}: importing {found} failed: {type(e).__name__}: {e}") from e
    return module


def resolve_reward(name: str | RewardFn, base_dir: str | Path | None = None) -> RewardFn:
    """A built-in by name, a plug-in, or a callable as is.

    A function with verl's signature `compute_score(data_source, solution_str, ground_truth, extra_info)` comes
    back wrapped as a reward function (`exactrl.tasks.verl_score`).

    Plug-ins are `"path/to/file.py:function"` (a relative path is looked up in `base_dir`, the config file's
    directory, then in the current directory) or `"module:function"` (imported with `base_dir` and the current
    directory on the import path). `function` may be a dotted attribute path (`"module:Class.attr"`).
    """
    if callable(name):
        return verl_score.adapt(name)
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown reward function {name!r}; built-ins: {', '.join(sorted(BUILTIN_REWARDS))}; "
            "or name a plug-in as 'path/to/file.py:function' or 'module:function'"
        )
    module_name, _, attr_path = name.rpartition(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward plug-in {name!r} must look like 'file.py:function' or 'module:function'")
    if module_name.endswith(".py"):
        module = _load_file_module(module_name, name, base_dir)
    else:
        added = [str(d) for d in _plugin_search_dirs(base_dir) if str(d) not in sys.path]
        sys.path[:0] = added
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # a plug-in may fail to import in any way; report which module and why
            raise ValueError(
                f"reward plug-in {name!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}"
            ) from e
        finally:
            for d in added:  # the module stays imported; the path change does not outlive the import
                if d in sys.path:
                    sys.path.remove(d)
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"reward plug-in {name!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(obj):
        raise ValueError(f"reward plug-in {name!r} is not callable (got {type(obj).__name__})")
    try:
        return verl_score.adapt(obj)
    except ValueError as e:
        raise ValueError(f"reward plug-in {name!r}: {e}") from None


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a reward function as batched: it is called once per batch with lists and returns a list of scores.

    Same as writing `fn.batched = True` after the function (which needs no import of exactrl)."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn
