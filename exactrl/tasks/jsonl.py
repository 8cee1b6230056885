"""A task read from JSON Lines files: one `{"prompt": ..., "answer": ...}` object per line.

Loading is eager and strict so that a broken dataset fails at start-up with `path:line` and the reason, not
hours into a run. Blank lines are skipped. Answers may be strings or numbers (converted with `str`; an integral
float such as `16.0` becomes `"16"` so it matches an integer completion under `exact_match`). Any other fields of
a record are kept in `Example.meta`, with `meta["_source"] = "path:line"`.

Held-out split: with `eval_path` the eval set is that file; otherwise all records are shuffled with `seed` and the
last `num_eval` become the eval set. Either way, training records whose prompt also occurs in the eval set are
dropped, so train and eval are disjoint by prompt even if the file has duplicates.

Training order: epoch e is a shuffle of the training records seeded by (seed, e); the cursor (epoch, index) is
saved by `state_dict`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exactrl.tasks.base import DatasetError, DatasetNotFoundError, Example

logger = logging.getLogger(__name__)


def _answer_to_str(value: Any) -> str | None:
    """The answer as text, or None if the JSON value is not a string or a finite number."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):  # a subclass of int, but `true` is not a numeric answer
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    return None


def load_jsonl(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer") -> list[Example]:
    """Read and validate a JSONL file. Raises `DatasetError` (or `DatasetNotFoundError`) naming `path:line`."""
    path = Path(path)
    try:
        handle = open(path, encoding="utf-8-sig")  # -sig: tolerate a byte-order mark written by some editors
    except FileNotFoundError as e:
        raise DatasetNotFoundError(f"dataset file not found: {path}") from e
    except OSError as e:
        raise DatasetError(f"cannot read dataset file {path}: {e}") from e
    examples: list[Example] = []
    with handle:
        lineno = 0
        try:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                examples.append(_parse_line(line, path, lineno, prompt_field, answer_field))
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}: not valid UTF-8 near line {lineno + 1} ({e.reason})") from e
    if not examples:
        raise DatasetError(f"{path}: no examples (the file is empty)")
    return examples


def _parse_line(line: str, path: Path, lineno: int, prompt_field: str, answer_field: str) -> Example:
    where = f"{path}:{lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name in (prompt_field, answer_field):
        if name not in record:
            raise DatasetError(
                f"{where}: missing field {name!r} (fields present: {', '.join(map(repr, record))})"
            )
    prompt = record[prompt_field]
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: field {prompt_field!r} must be a string, got {type(prompt).__name__}")
    answer = _answer_to_str(record[answer_field])
    if answer is None:
        raise DatasetError(
            f"{where}: field {answer_field!r} must be a string or a finite number, got {record[answer_field]!r}"
        )
    meta = {k: v for k, v in record.items() if k not in (prompt_field, answer_field)}
    meta["_source"] = where
    return Example(prompt=prompt, answer=answer, meta=meta)


class JsonlTask:
    """Examples from a JSONL file; see the module docstring for the split and the training order."""

    def __init__(
        self,
        path: str | Path,
        eval_path: str | Path | None = None,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        num_eval: int = 200,
        seed: int = 0,
    ) -> None:
        self.path = Path(path)
        self.name = f"jsonl:{self.path.stem}"
        self.seed = seed
        examples = load_jsonl(self.path, prompt_field, answer_field)
        if eval_path is not None:
            train = examples
            held_out = load_jsonl(eval_path, prompt_field, answer_field)
        else:
            if num_eval < 0:
                raise ValueError(f"num_eval must be >= 0, got {num_eval}")
            if num_eval >= len(examples):
                raise DatasetError(
                    f"{self.path}: {len(examples)} examples, cannot hold out num_eval={num_eval} and still train; "
                    "lower num_eval or give an eval_path"
                )
            order = list(range(len(examples)))
            random.Random(f"exactrl-jsonl-split:{seed}").shuffle(order)
            cut = len(order) - num_eval
            train = [examples[i] for i in order[:cut]]
            held_out = [examples[i] for i in order[cut:]]
        eval_prompts = {ex.prompt for ex in held_out}
        self._train = [ex for ex in train if ex.prompt not in eval_prompts]
        self.num_dropped_overlap = len(train) - len(self._train)
        if self.num_dropped_overlap:
            logger.warning(
                "%s: dropped %d training examples whose prompt is also in the eval set",
                self.path,
                self.num_dropped_overlap,
            )
        if not self._train:
            raise DatasetError(f"{self.path}: no training examples left after removing the eval prompts")
        self._eval = held_out
        # Identifies the training data, so a resumed run notices if the file changed under it.
        digest = hashlib.sha256()
        for ex in self._train:
            digest.update(json.dumps([ex.prompt, ex.answer]).encode())
        self._fingerprint = digest.hexdigest()[:16]
        self._epoch = 0
        self._index = 0
        self._order_cache: tuple[int, int, list[int]] | None = None  # (seed, epoch, permutation)

    @property
    def num_train(self) -> int:
        return len(self._train)

    @property
    def num_eval(self) -> int:
        return len(self._eval)

    def _order(self, seed: int, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[:2] != (seed, epoch):
            order = list(range(len(self._train)))
            random.Random(f"exactrl-jsonl-train:{seed}:{epoch}").shuffle(order)
            self._order_cache = (seed, epoch, order)
        return self._order_cache[2]

    def train_examples(self, seed: int | None = None) -> Iterator[Example]:
        """Endless stream of shuffled epochs from the cursor. A seed other than the cursor's restarts at epoch 0.

        The generator reads and advances the task's cursor on every step, so `load_state_dict` takes effect even
        on an iterator that is already live.
        """
        if seed is not None and seed != self.seed:
            self.seed, self._epoch, self._index = seed, 0, 0
        while True:
            if self._index >= len(self._train):
                self._epoch, self._index = self._epoch + 1, 0
            example = self._train[self._order(self.seed, self._epoch)[self._index]]
            self._index += 1  # consumed once handed out: a checkpoint taken now must not replay it
            yield example

    def eval_examples(self, num: int | None = None) -> list[Example]:
        """The first `num` held-out examples (all if None), in a fixed order."""
        return list(self._eval if num is None else self._eval[:num])

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "epoch": self._epoch,
            "index": self._index,
            "num_train": len(self._train),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor. Refuses a state saved for different training data: its positions would be meaningless."""
        fingerprint = state.get("fingerprint")
        if fingerprint is not None and fingerprint != self._fingerprint:
            raise ValueError(
                f"{self.path}: training data differs from the run that saved this state "
                f"({state.get('num_train')} examples then, {len(self._train)} now)"
            )
        self.seed = int(state["seed"])
        self._epoch = int(state["epoch"])
        self._index = int(state["index"])
