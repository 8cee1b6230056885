"""Reward functions and the guarded runner that applies them to a batch of completions.

A reward function is `fn(completion: str, answer: str, example: Example) -> float`. Built-ins live in the plain
dict `BUILTIN_REWARDS`; anything else is named as `"module:function"` and imported (`resolve_reward`).

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

Guarding (`RewardComputer`): each (function, sample) call runs in a daemon worker thread with a per-call timeout
measured from when the call starts. A call that raises, returns something that is not a finite real number, or
runs past the timeout scores 0.0 and is counted; the batch goes on. Threads rather than processes because reward
functions are usually microseconds of string work, plug-ins need not be picklable, and forking a process that holds
CUDA state is unsafe. The cost of threads: a timed-out call cannot be killed. Its thread is abandoned (a fresh worker
replaces it) and, being a daemon thread, never blocks interpreter exit; but a function stuck in a busy loop keeps
taking a share of the GIL until the process ends, so fix such a function rather than rely on the timeout.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

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


def resolve_reward(name: str | RewardFn) -> RewardFn:
    """A built-in by name, a plug-in given as `"module:function"` (or `"module:Class.attr"`), or a callable as is."""
    if callable(name):
        return name
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown reward function {name!r}; built-ins: {', '.join(sorted(BUILTIN_REWARDS))}; "
            "or name a plug-in as 'module:function'"
        )
    module_name, _, attr_path = name.rpartition(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward plug-in {name!r} must look like 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a plug-in may fail to import in any way; report which module and why
        raise ValueError(
            f"reward plug-in {name!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}"
        ) from e
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"reward plug-in {name!r}: module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(obj):
        raise ValueError(f"reward plug-in {name!r} is not callable (got {type(obj).__name__})")
    return obj


# ---------------------------------------------------------------------------------------------------------------
# Guarded batch evaluation


@dataclass
class RewardResult:
    """`rewards[i]` is the weighted sum over functions for sample i; failed calls contribute 0.0."""

    rewards: list[float]
    per_function: dict[str, list[float]]
    num_errors: dict[str, int]
    num_timeouts: dict[str, int]
    # The first error of each function in this batch, as "ExceptionType: message", for the log.
    first_error: dict[str, str] = field(default_factory=dict)


class _Batch:
    def __init__(self, num_jobs: int) -> None:
        self.cond = threading.Condition()
        self.remaining = num_jobs


class _Job:
    __slots__ = ("fn", "args", "batch", "started_at", "done", "abandoned", "value", "error")

    def __init__(self, fn: RewardFn, args: tuple[Any, ...], batch: _Batch) -> None:
        self.fn = fn
        self.args = args
        self.batch = batch
        self.started_at: float | None = None
        self.done = False
        self.abandoned = False
        self.value: Any = None
        self.error: BaseException | None = None


def _worker(jobs: queue.SimpleQueue) -> None:
    # Holds only the queue (never the RewardComputer), so the computer can be collected and close the pool.
    while True:
        job = jobs.get()
        if job is None:
            return
        cond = job.batch.cond
        with cond:
            job.started_at = time.monotonic()
        try:
            value, error = job.fn(*job.args), None
        except BaseException as e:  # noqa: BLE001 - a plug-in's SystemExit must not kill the worker either
            value, error = None, e
        with cond:
            if job.abandoned:
                return  # timed out: a replacement worker took this one's place
            job.value, job.error, job.done = value, error, True
            job.batch.remaining -= 1
            if job.batch.remaining == 0:
                cond.notify_all()


def _stop_workers(jobs: queue.SimpleQueue, count: int) -> None:
    for _ in range(count):
        jobs.put(None)


class RewardComputer:
    """Apply reward functions to completions with per-call error and timeout isolation (see module docstring)."""

    def __init__(
        self,
        functions: Sequence[str | RewardFn],
        weights: Sequence[float] | None = None,
        timeout_s: float = 5.0,
        max_workers: int = 4,
    ) -> None:
        if not functions:
            raise ValueError("need at least one reward function")
        self.names = [f if isinstance(f, str) else getattr(f, "__qualname__", repr(f)) for f in functions]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"reward functions are listed more than once: {self.names}")
        self.functions = [resolve_reward(f) for f in functions]
        weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        if len(weights) != len(functions):
            raise ValueError(f"{len(weights)} weights for {len(functions)} reward functions")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward weights must be finite, got {weights}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.weights = weights
        self.timeout_s = float(timeout_s)
        self.max_workers = max_workers
        self.num_abandoned_threads = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._num_workers = 0
        self._call_lock = threading.Lock()  # one batch at a time: the timeout bookkeeping assumes it
        self._finalizer: weakref.finalize | None = None

    def _spawn_worker(self) -> None:
        threading.Thread(target=_worker, args=(self._jobs,), name="exactrl-reward", daemon=True).start()
        self._num_workers += 1

    def _ensure_workers(self) -> None:
        while self._num_workers < self.max_workers:
            self._spawn_worker()
        if self._finalizer is None:
            # Idle workers block on the queue forever; tell them to exit when this computer goes away.
            self._finalizer = weakref.finalize(self, _stop_workers, self._jobs, self.max_workers)

    def close(self) -> None:
        """Stop the idle workers (abandoned ones end when their call returns, or with the process)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
            self._num_workers = 0

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
        with self._call_lock:
            self._ensure_workers()
            batch = _Batch(n * len(self.functions))
            jobs = [
                [_Job(fn, (completions[i], answers[i], examples[i]), batch) for i in range(n)]
                for fn in self.functions
            ]
            for row in jobs:
                for job in row:
                    self._jobs.put(job)
            timed_out = self._wait(batch, [job for row in jobs for job in row])

        per_function: dict[str, list[float]] = {}
        num_errors: dict[str, int] = {}
        num_timeouts: dict[str, int] = {}
        first_error: dict[str, str] = {}
        for name, row in zip(self.names, jobs):
            scores = []
            errors = timeouts = 0
            for job in row:
                if job in timed_out:
                    timeouts += 1
                    scores.append(0.0)
                    continue
                score, problem = _as_score(job)
                if problem is not None:
                    errors += 1
                    first_error.setdefault(name, problem)
                scores.append(score)
            per_function[name] = scores
            num_errors[name] = errors
            num_timeouts[name] = timeouts
            if errors or timeouts:
                logger.warning(
                    "reward %r: %d errors, %d timeouts (> %.3gs) in %d samples%s",
                    name,
                    errors,
                    timeouts,
                    self.timeout_s,
                    n,
                    f"; first error: {first_error[name]}" if name in first_error else "",
                )
        rewards = [
            sum(w * per_function[name][i] for name, w in zip(self.names, self.weights)) for i in range(n)
        ]
        return RewardResult(rewards, per_function, num_errors, num_timeouts, first_error)

    def _wait(self, batch: _Batch, jobs: list[_Job]) -> set[_Job]:
        """Block until every job finished or overran its timeout; returns the overrunning ones.

        The main thread sleeps until the earliest deadline among started calls (or one timeout from now): a call
        that starts after that computation cannot be due before the wake-up, so no start notifications are needed.
        """
        timed_out: set[_Job] = set()
        with batch.cond:
            while batch.remaining > 0:
                now = time.monotonic()
                wake = now + self.timeout_s
                for job in jobs:
                    if job.done or job.abandoned or job.started_at is None:
                        continue
                    deadline = job.started_at + self.timeout_s
                    if deadline <= now:
                        job.abandoned = True
                        timed_out.add(job)
                        batch.remaining -= 1
                        # The stuck thread is lost to the pool; keep the pool at strength so queued calls still run.
                        self._num_workers -= 1
                        self.num_abandoned_threads += 1
                        self._spawn_worker()
                    else:
                        wake = min(wake, deadline)
                if batch.remaining > 0:
                    batch.cond.wait(max(wake - time.monotonic(), 0.001))
        return timed_out


def _as_score(job: _Job) -> tuple[float, str | None]:
    """(score, None) for a finite real result, else (0.0, what went wrong)."""
    if job.error is not None:
        return 0.0, f"{type(job.error).__name__}: {job.error}"
    value = job.value
    if isinstance(value, (str, bytes)) or value is None:
        return 0.0, f"returned {type(value).__name__}, not a number"
    try:
        score = float(value) if isinstance(value, numbers.Real) else float(value.__float__())
    except Exception as e:  # noqa: BLE001 - e.g. a multi-element tensor
        return 0.0, f"returned {type(value).__name__}, not a number ({e})"
    if not math.isfinite(score):
        return 0.0, f"returned non-finite {score}"
    return score, None
