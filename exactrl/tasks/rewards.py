"""The guarded runner that applies reward functions to a batch of completions (the functions themselves, and
`resolve_reward`: exactrl.tasks.reward_fns, whose names this module also exports).

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
import inspect
import logging
import math
import pickle
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exactrl.tasks import reward_pool
from exactrl.tasks.base import Example
from exactrl.tasks.reward_fns import (
    BUILTIN_REWARDS,
    CORRECT_ABOVE,
    RewardFn,
    _plugin_search_dirs,
    accuracy_function,
    batched,
    exact_match,
    extract_answer,
    format_reward,
    no_accuracy_notice,
    numeric_match,
    parse_number,
    resolve_reward,
)

# The functions' names (exactrl.tasks.reward_fns) are exported here too, as they always were.
__all__ = [
    "BUILTIN_REWARDS",
    "CORRECT_ABOVE",
    "RewardComputer",
    "RewardFn",
    "RewardResult",
    "accuracy_function",
    "batched",
    "exact_match",
    "extract_answer",
    "format_reward",
    "no_accuracy_notice",
    "numeric_match",
    "parse_number",
    "resolve_reward",
]

logger = logging.getLogger(__name__)

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
        for c, a, ex in zip(completions, answers, examples):
            try:
                value, error = _run_maybe_async(term.fn, (c, a, ex)), None
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
