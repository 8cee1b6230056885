"""Reward functions and the guarded runner that applies them to a batch of completions.

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

Accuracy is the share of samples that the task's correctness function scores above `CORRECT_ABOVE` (0.5), never the
summed reward: with a format bonus in the list, a wrong answer in the right format must not count as correct. Which
function is the verdict: `accuracy_function` (reward.accuracy, by default the built-in correctness function, else
the first listed function that is not a shaping reward, else none: accuracy is then not reported).

Guarding (`RewardComputer`): built-ins run in the calling process; every other function runs in a worker process
that is killed and replaced when a call runs past `timeout_s` (see `RewardComputer` and `exactrl.tasks.reward_pool`).
A call that raises, returns something that is not a finite real number within float32's range (the dtype the loop
keeps rewards in: 1e300 would become inf there), or times out scores 0.0 and is counted per function; an error's
description names the line of the user's file it came from.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import pickle
import re
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from exactrl.tasks import reward_pool, verl_score
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
        value = Fraction(mantissa) * Fraction(10) ** int(exponent or 0)
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
    return abs(x - y) <= _REL_TOL * max(1, abs(y))


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


# ---------------------------------------------------------------------------------------------------------------
# Guarded batch evaluation


@dataclass
class RewardResult:
    """`rewards[i]` is the weighted sum over functions for sample i; failed calls contribute 0.0."""

    rewards: list[float]
    per_function: dict[str, list[float]]
    num_errors: dict[str, int]
    num_timeouts: dict[str, int]
    # The first error of each function in this batch, as "ExceptionType: message (at file:line in function)".
    first_error: dict[str, str] = field(default_factory=dict)
    # correct[i]: the correctness function scored sample i above CORRECT_ABOVE (a failed call is not correct);
    # None when the computer has no correctness function (`RewardComputer.accuracy_fn`).
    correct: list[bool] | None = None


@dataclass
class _Term:
    name: str
    weight: float
    fn: Any  # the callable (inline terms); for worker terms only used to read flags
    inline: bool
    batched: bool = False
    is_async: bool = False
    worker_index: int = -1  # index into the pool's function list


class RewardComputer:
    """Apply reward functions to completions, scoring a failed call 0 and counting it.

    Where each function runs:
      * built-ins (and a `RewardModel`) run in this process: they are our own code, bounded, and a model must stay
        on the run's device;
      * every other function runs in a worker process (`exactrl.tasks.reward_pool`), started when the computer is
        built (so an import error in a reward file fails the run at start-up, naming the file). A call past
        `timeout_s` has its worker killed and replaced and counts as a timeout (score 0). The limit holds per call:
        a per-sample call, a whole batched call, or each coroutine of an `async def` per-sample function (whose
        calls for a batch run concurrently on one event loop).
      * with `isolation="inline"` every function runs in this thread, with no timeout (for a debugger, or for
        callables that cannot be sent to another process, such as lambdas).

    A call that raises, returns something that is not a finite real number within float32's range (a batched one:
    not one per sample), or runs past the timeout scores 0.0 and is counted; the batch goes on. A function that
    fails on more than `max_error_share` of a batch's calls is logged as a warning with its first error and the
    line of the user's file it came from. `calls` and `failures` count calls per function over the computer's life;
    `all_calls_failed()` says whether every call of the run failed, `accuracy_failure()` whether every call of the
    correctness function did.

    accuracy: which function's verdict is accuracy (`accuracy_function`: a listed name, "auto" or "off");
    the result's `correct` holds it per sample, `accuracy_fn` names it.
    """

    def __init__(
        self,
        functions: Sequence[str | RewardFn],
        weights: Sequence[float] | None = None,
        timeout_s: float = 5.0,
        max_workers: int | None = None,
        *,
        base_dir: str | Path | None = None,
        isolation: str = "process",
        accuracy: str = "auto",
        max_error_share: float = 0.5,
    ) -> None:
        if not functions:
            raise ValueError("need at least one reward function")
        if isolation not in ("process", "inline"):
            raise ValueError(f"isolation must be 'process' or 'inline', got {isolation!r}")
        names = [f if isinstance(f, str) else getattr(f, "__qualname__", repr(f)) for f in functions]
        if len(set(names)) != len(names):
            raise ValueError(f"reward functions are listed more than once: {names}")
        weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        if len(weights) != len(functions):
            raise ValueError(f"{len(weights)} weights for {len(functions)} reward functions")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward weights must be finite, got {weights}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if not 0.0 <= max_error_share <= 1.0:
            raise ValueError(f"max_error_share must be within [0, 1], got {max_error_share}")
        self.accuracy_fn = accuracy_function(names, accuracy)
        if self.accuracy_fn is None and accuracy == "auto":
            logger.warning(no_accuracy_notice(names))
        self.max_error_share = float(max_error_share)
        self.names = names
        self.weights = weights
        self.timeout_s = float(timeout_s)
        self.base_dir = None if base_dir is None else str(base_dir)
        self.isolation = isolation
        self.calls = dict.fromkeys(names, 0)
        self.failures = dict.fromkeys(names, 0)
        self.first_errors: dict[str, str] = {}  # each function's first error over the computer's life
        self._terms: list[_Term] = []
        refs: list[reward_pool.FunctionRef] = []
        for name, fn, w in zip(names, functions, weights):
            if isinstance(fn, str) and fn in BUILTIN_REWARDS:
                self._terms.append(_Term(name, w, BUILTIN_REWARDS[fn], inline=True))
            elif isolation == "inline" or getattr(fn, "exactrl_inline", False) is True:
                resolved = resolve_reward(fn, base_dir)
                batched_, async_ = reward_pool.flags_of(resolved)
                self._terms.append(_Term(name, w, resolved, True, batched_, async_))
            else:
                self._terms.append(_Term(name, w, fn, inline=False, worker_index=len(refs)))
                refs.append(_worker_ref(name, fn, self.base_dir))
        self._pool: reward_pool.WorkerPool | None = None
        self._finalizer: weakref.finalize | None = None
        if refs:
            size = max_workers if max_workers is not None else reward_pool.default_workers()
            search = [str(d) for d in _plugin_search_dirs(self.base_dir)]
            self._pool = reward_pool.WorkerPool(refs, size, sys_path=search)
            # Kills the workers when the computer is collected or the interpreter exits.
            self._finalizer = weakref.finalize(self, reward_pool.close_pool, self._pool)
            status = self._pool.start_one()  # resolve every plug-in now: a bad one fails at start-up
            for term in self._terms:
                if term.inline:
                    continue
                ok, info = status[term.worker_index]
                if ok != "ok":
                    self.close()
                    raise ValueError(_plugin_error(term.name, info))
                term.batched, term.is_async = info

    @classmethod
    def from_config(
        cls, reward: Any, *, device: str = "cpu", base_dir: str | Path | None = None
    ) -> RewardComputer:
        """The computer a `[reward]` config section describes (`exactrl.config.RewardConfig`, read by attribute):
        its functions and, with `reward.model`, the learned reward model on `device`, weighted by model_weight.
        `base_dir`: where relative reward files and modules are looked up first (the CLI leaves it unset: the
        working directory)."""
        functions: list[Any] = list(reward.functions)
        weights = list(reward.weights) if reward.weights else [1.0] * len(functions)
        # Chosen among the listed functions only: a reward model's score is a preference, not a verdict.
        accuracy = accuracy_function(functions, getattr(reward, "accuracy", "auto"))
        if accuracy is None and getattr(reward, "accuracy", "auto") == "auto":
            logger.warning(no_accuracy_notice(functions))
        if reward.model:
            from exactrl.tasks.reward_model import RewardModel

            model_path = Path(reward.model).expanduser()
            if (
                not model_path.is_absolute()
                and base_dir is not None
                and (Path(base_dir) / model_path).exists()
            ):
                model_path = Path(base_dir) / model_path
            functions.append(
                RewardModel(
                    model_path,
                    device=device,
                    dtype=reward.model_dtype,
                    label=reward.model_label,
                    batch_size=reward.model_batch_size,
                    max_tokens=reward.model_max_tokens,
                )
            )
            weights.append(reward.model_weight)
        return cls(
            functions,
            weights,
            reward.timeout_s,
            base_dir=base_dir,
            accuracy=accuracy if accuracy is not None else "off",
            max_error_share=getattr(reward, "max_error_share", 0.5),
        )

    @property
    def num_killed_workers(self) -> int:
        """Worker processes killed because a call ran past the timeout."""
        return 0 if self._pool is None else self._pool.num_killed

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def __enter__(self) -> RewardComputer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(
        self, completions: Sequence[str], answers: Sequence[str], examples: Sequence[Example]
    ) -> RewardResult:
        if not len(completions) == len(answers) == len(examples):
            raise ValueError(
                f"got {len(completions)} completions, {len(answers)} answers and {len(examples)} examples"
            )
        n = len(completions)
        completions, answers, examples = list(completions), list(answers), list(examples)
        # outcome[name][i] = (score, problem) with problem None, "timeout" or the error text.
        outcome: dict[str, list[tuple[float, str | None]]] = {}
        jobs: list[tuple[_Term, list[int], reward_pool.Job]] = []
        size = self._pool.size if self._pool is not None else 1
        for term in self._terms:
            if term.inline:
                outcome[term.name] = self._run_inline(term, completions, answers, examples)
                continue
            if term.batched:
                payload = (completions, answers, examples)
                jobs.append(
                    (
                        term,
                        list(range(n)),
                        reward_pool.Job("batch", term.worker_index, payload, self.timeout_s, n),
                    )
                )
                continue
            # Per-sample functions: chunks, a few per worker so that the workers finish together. Coroutines of one
            # chunk run concurrently; plain calls run one by one, each with its own timeout.
            for chunk in _chunks(n, size if term.is_async else 4 * size):
                samples = [(completions[i], answers[i], examples[i]) for i in chunk]
                if term.is_async:
                    limit = self.timeout_s + reward_pool.ASYNC_GRACE_S
                    job = reward_pool.Job(
                        "gather", term.worker_index, (samples, self.timeout_s), limit, len(chunk)
                    )
                else:
                    job = reward_pool.Job("calls", term.worker_index, samples, self.timeout_s, len(chunk))
                jobs.append((term, chunk, job))
        if jobs:
            assert self._pool is not None
            self._pool.run([job for _, _, job in jobs])
        for term, idx, job in jobs:
            scores = outcome.setdefault(term.name, [(0.0, None)] * n)
            for i, pair in zip(idx, job.scores()):
                scores[i] = pair
        return self._result(outcome, n)

    def _run_inline(
        self, term: _Term, completions: list[str], answers: list[str], examples: list[Example]
    ) -> list[tuple[float, str | None]]:
        n = len(completions)
        if term.batched:
            try:
                values = _run_maybe_async(term.fn, (completions, answers, examples))
            except Exception as e:  # noqa: BLE001
                return [reward_pool.as_score(None, e, term.fn)] * n
            return reward_pool.as_scores(values, n)
        out = []
        for c, a, e in zip(completions, answers, examples):
            try:
                value, error = _run_maybe_async(term.fn, (c, a, e)), None
            except Exception as err:  # noqa: BLE001
                value, error = None, err
            out.append(reward_pool.as_score(value, error, term.fn))
        return out

    def _result(self, outcome: dict[str, list[tuple[float, str | None]]], n: int) -> RewardResult:
        per_function: dict[str, list[float]] = {}
        num_errors: dict[str, int] = {}
        num_timeouts: dict[str, int] = {}
        first_error: dict[str, str] = {}
        for name in self.names:
            pairs = outcome[name]
            per_function[name] = [s for s, _ in pairs]
            timeouts = sum(p == "timeout" for _, p in pairs)
            errors = sum(p is not None and p != "timeout" for _, p in pairs)
            first = next((p for _, p in pairs if p is not None and p != "timeout"), None)
            if first is not None:
                first_error[name] = first
            num_errors[name], num_timeouts[name] = errors, timeouts
            self.calls[name] += n
            self.failures[name] += errors + timeouts
            if first is not None:
                self.first_errors.setdefault(name, first)
            if errors or timeouts:
                # Loud past the share (a broken function), quiet below it (the counts are in the metrics).
                loud = errors + timeouts > self.max_error_share * n
                logger.log(
                    logging.WARNING if loud else logging.INFO,
                    "reward %r failed on %d of %d calls (%d errors, %d timeouts > %.3g s)%s%s",
                    name,
                    errors + timeouts,
                    n,
                    errors,
                    timeouts,
                    self.timeout_s,
                    f", more than reward.max_error_share = {self.max_error_share:g}" if loud else "",
                    f"; first error: {first}" if first is not None else "",
                )
        rewards = [
            sum(w * per_function[name][i] for name, w in zip(self.names, self.weights)) for i in range(n)
        ]
        correct = None
        if self.accuracy_fn is not None:
            correct = [score > CORRECT_ABOVE for score in per_function[self.accuracy_fn]]
        return RewardResult(rewards, per_function, num_errors, num_timeouts, first_error, correct)

    def all_calls_failed(self) -> bool:
        """True when reward functions were called and every call (of every function) failed: the run learned from
        nothing but zeros, which must not end as a success."""
        total = sum(self.calls.values())
        return total > 0 and sum(self.failures.values()) == total

    def failure_summary(self) -> str | None:
        """A line for the run's summary when every call of some function failed, else None."""
        broken = [n for n in self.names if self.calls[n] > 0 and self.failures[n] == self.calls[n]]
        if not broken:
            return None
        which = "; ".join(f"{n!r} ({self.calls[n]} calls{self._first_error_text(n)})" for n in broken)
        head = "every reward call failed" if self.all_calls_failed() else "every call failed for"
        return f"{head}: {which}"

    def accuracy_failure(self) -> str | None:
        """A line for the run's summary when the correctness function was called and every call failed: accuracy
        then counts nothing and the policy never got the reward that says what is right. None otherwise."""
        name = self.accuracy_fn
        if name is None or self.calls[name] == 0 or self.failures[name] < self.calls[name]:
            return None
        return (
            f"every call of the correctness function {name!r} failed ({self.calls[name]} calls"
            f"{self._first_error_text(name)})"
        )

    def run_failure(self) -> str | None:
        """Why a run that used this computer must not end as a success, or None: every reward call failed, or
        every call of the correctness function did (whatever the other functions scored)."""
        if self.all_calls_failed():
            return self.failure_summary()
        return self.accuracy_failure()

    def _first_error_text(self, name: str) -> str:
        first = self.first_errors.get(name)
        if first is not None:
            return f"; first error: {first}"
        return f"; every failure a timeout, reward.timeout_s = {self.timeout_s:g}"


def _chunks(n: int, parts: int) -> list[list[int]]:
    """0..n-1 in at most `parts` contiguous chunks of near-equal size."""
    parts = max(1, min(parts, n))
    bounds = [n * k // parts for k in range(parts + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(parts)] if n else []


def _run_maybe_async(fn: Any, args: tuple[Any, ...]) -> Any:
    value = fn(*args)
    if inspect.isawaitable(value):
        return asyncio.run(reward_pool._awaited(value))
    return value


def _worker_ref(name: str, fn: str | RewardFn, base_dir: str | None) -> reward_pool.FunctionRef:
    """How a worker finds the function: by its spec, or by value for a callable (pickled by reference)."""
    if isinstance(fn, str):
        if ":" not in fn:
            resolve_reward(fn)  # raises the "unknown reward function" error with the list of built-ins
        return ("spec", fn, base_dir)
    try:
        return ("pickled", pickle.dumps(fn), None)
    except Exception as e:  # noqa: BLE001 - lambdas, closures, bound methods of local classes
        raise ValueError(
            f"reward function {name!r} cannot be sent to a worker process ({type(e).__name__}: {e}); define it at "
            "the top level of a file and name it as 'path/to/file.py:function', or use isolation='inline' "
            "(no timeout)"
        ) from None


def _plugin_error(name: str, info: str) -> str:
    # resolve_reward's own messages already name the plug-in; keep them as they are.
    return (
        info.split(": ", 1)[1]
        if info.startswith("ValueError: reward plug-in")
        else f"reward {name!r}: {info}"
    )
