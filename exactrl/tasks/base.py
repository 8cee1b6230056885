"""What a task is: a stream of training examples, a fixed held-out eval set, and a resumable cursor.

A prompt is a string or a chat (a list of `{"role", "content"}` messages). Turning it into a model input is a
separate step (`exactrl.tasks.chat.render_prompt`) so the same task serves base models and chat models alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class Example:
    """One verifiable problem: the model sees `prompt` (a string, or a list of chat messages), reward functions
    compare its completion to `answer`.

    `meta` carries whatever else a reward function may need (the operands of an arithmetic problem, the extra
    fields of a JSONL record, where the record came from).
    """

    prompt: str | list[dict[str, str]]
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class DatasetError(ValueError):
    """A dataset could not be loaded; the message names the file (and line) and what is wrong."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """The dataset file does not exist. Also a `FileNotFoundError`, so generic handlers still catch it."""


@runtime_checkable
class Task(Protocol):
    """A verifiable task.

    Contract:
      * `train_examples(seed)` yields training examples (endless or finite) from the task's cursor. The cursor
        advances as examples are handed out, so `state_dict()` taken after consuming N examples and loaded into
        a fresh task makes its `train_examples(seed)` continue with example N+1. Passing a seed other than the
        cursor's starts a new stream for that seed from the beginning.
      * `eval_examples(num)` returns a fixed held-out list (same for every seed and call; a shorter request is
        a prefix of a longer one) that is disjoint from anything `train_examples` can yield, by construction.
      * `state_dict()` is plain JSON-serialisable data.
    """

    name: str

    def train_examples(self, seed: int | None = None) -> Iterator[Example]: ...

    def eval_examples(self, num: int | None = None) -> list[Example]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
