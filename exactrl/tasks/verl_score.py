"""verl's reward signature, taken as it is: `compute_score(data_source, solution_str, ground_truth, extra_info)`.

A function is recognised by its parameter names (`solution_str` and `ground_truth`; the batched form has
`solution_strs` and `ground_truths`) and called by keyword with those of the four it has:
  * data_source: the example's record field `data_source` (None when the record has none),
  * solution_str: the completion,
  * ground_truth: the example's answer (`task.answer_field`),
  * extra_info: the record field `extra_info`, or {} when the record has none.
It may return a number or a dict `{"score": s, ...}` (its other keys are ignored; `reward_pool.as_score`).
`async def` functions stay async; a batched one (plural names) is called once per batch like `batched = True`.
"""

from __future__ import annotations

import inspect
from typing import Any

from exactrl.tasks.base import Example

_SINGLE = ("data_source", "solution_str", "ground_truth", "extra_info")
_BATCHED = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def _fields(completion: str, answer: str, example: Example) -> tuple[Any, str, str, Any]:
    meta = example.meta if isinstance(example.meta, dict) else {}
    extra = meta.get("extra_info")
    return meta.get("data_source"), completion, answer, extra if extra is not None else {}


class VerlScore:
    """A verl-style function as a reward function `(completion, answer, example) -> score`."""

    def __init__(self, fn: Any, names: list[str], batched: bool) -> None:
        self.__wrapped__ = fn  # inspect.unwrap finds the user's function (its file names an error's place)
        self.fn = fn
        self.names = names  # the keyword arguments fn takes, in verl's order
        self.batched = batched
        self.__qualname__ = getattr(fn, "__qualname__", repr(fn))

    def kwargs(self, completions: Any, answers: Any, examples: Any) -> dict[str, Any]:
        """The keyword arguments of one call (of a batch: one list per argument)."""
        if self.batched:
            rows = [_fields(c, a, e) for c, a, e in zip(completions, answers, examples)]
            values: tuple[Any, ...] = tuple([row[k] for row in rows] for k in range(4))
        else:
            values = _fields(completions, answers, examples)
        return {name: values[_slot(name)] for name in self.names}

    def __call__(self, completion: Any, answer: Any, example: Any) -> Any:
        return self.fn(**self.kwargs(completion, answer, example))


class AsyncVerlScore(VerlScore):
    """The same for an `async def` function (so that its calls for a batch run concurrently)."""

    async def __call__(self, completion: Any, answer: Any, example: Any) -> Any:  # type: ignore[override]
        return await self.fn(**self.kwargs(completion, answer, example))


def _slot(name: str) -> int:
    """Which of (data_source, solution_str, ground_truth, extra_info) a parameter name is, singular or plural."""
    return _SINGLE.index(name) if name in _SINGLE else _BATCHED.index(name)


def adapt(fn: Any) -> Any:
    """`fn` wrapped as a reward function if it has verl's signature, else `fn` itself. A verl-style function
    that needs an argument this adapter cannot give is refused by name."""
    if isinstance(fn, VerlScore):
        return fn
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or an object without a signature: not verl-style
        return fn
    if "solution_str" in params and "ground_truth" in params:
        names, batched = _SINGLE, False
    elif "solution_strs" in params and "ground_truths" in params:
        names, batched = _BATCHED, True
    else:
        return fn
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [
        p.name
        for p in params.values()
        if p.name not in names
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    where = getattr(fn, "__qualname__", repr(fn))
    if missing:
        raise ValueError(
            f"reward function {where!r} looks like verl's compute_score({', '.join(names)}) but also needs "
            f"{missing}, which exactrl cannot pass: give them defaults"
        )
    positional_only = [p.name for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    if positional_only:
        raise ValueError(
            f"reward function {where!r}: verl-style arguments are passed by keyword, but {positional_only} are "
            "positional-only"
        )
    taken = [n for n in names if n in params or takes_any]
    is_async = inspect.iscoroutinefunction(fn)
    wrapper = (AsyncVerlScore if is_async else VerlScore)(fn, taken, batched)
    if getattr(fn, "batched", False) is True:  # already marked: keep it so
        wrapper.batched = True
    return wrapper
