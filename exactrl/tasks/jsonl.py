"""A task read from a dataset file: JSON Lines (one object per line) or parquet (one row per record).

A record gives a prompt and a reference answer, found by field paths: `"prompt"`, or a dotted path into nested
objects such as `"reward_model.ground_truth"` (verl's layout; a list element is a number: `"turns.0.text"`). The
prompt is a string, or a chat: a list of `{"role": ..., "content": ...}` messages that the chat template renders.
Answers may be strings or numbers (converted with `str`; an integral float such as `16.0` becomes `"16"` so it
matches an integer completion under `exact_match`). The record's other top-level fields are kept in `Example.meta`
(e.g. `data_source`, `extra_info`), with `meta["_source"] = "path:line"` (for parquet, the row number from 1).

A bad record (invalid JSON or UTF-8, not an object, a missing field, a wrong type, an empty prompt) is skipped,
counted and logged with `path:line` and the reason; a file with no good record at all is an error. Blank lines are
skipped silently.

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

FORMATS = ("jsonl", "parquet")
_PARQUET_MAGIC = b"PAR1"
# Bad records named one by one in the log; the rest are counted.
_MAX_LOGGED = 20


class BadRecord(ValueError):
    """One record could not be used; the message says why (the caller adds where)."""


def _answer_to_str(value: Any) -> str | None:
    """The answer as text, or None if the value is not a string or a finite number."""
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


_MISSING = object()


def get_field(record: dict[str, Any], path: str) -> Any:
    """`record[path]`, or the value at a dotted path (`"reward_model.ground_truth"`, `"turns.0.text"`).

    A key that itself contains dots is found as it is first. Raises `BadRecord` naming the part that is missing."""
    if path in record:
        return record[path]
    value: Any = record
    walked: list[str] = []
    for part in path.split("."):
        if isinstance(value, dict):
            value = value.get(part, _MISSING)
        elif isinstance(value, list) and part.isdigit():
            value = value[int(part)] if int(part) < len(value) else _MISSING
        else:
            value = _MISSING
        if value is _MISSING:
            if "." not in path:
                raise BadRecord(f"missing field {path!r}")
            where = f" in {'.'.join(walked)!r}" if walked else ""
            raise BadRecord(f"missing field {path!r} (no {part!r}{where})")
        walked.append(part)
    return value


def _prompt_of(value: Any, field_name: str) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        if not value.strip():
            raise BadRecord(f"field {field_name!r} is an empty prompt")
        return value
    if isinstance(value, (list, tuple)):
        # A chat: [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]. Parquet may give tuples.
        if not value:
            raise BadRecord(f"field {field_name!r} is an empty list of messages")
        messages = []
        for i, m in enumerate(value):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise BadRecord(
                    f'field {field_name!r}[{i}] must be a message {{"role": str, "content": str}}, got {_short(m)}'
                )
            messages.append({"role": m["role"], "content": m["content"]})
        if not any(m["content"].strip() for m in messages):
            raise BadRecord(f"field {field_name!r}: every message is empty")
        return messages
    raise BadRecord(
        f"field {field_name!r} must be a string or a list of messages, got {type(value).__name__}"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_record(
    record: Any, prompt_field: str = "prompt", answer_field: str = "answer"
) -> tuple[Any, str, dict]:
    """(prompt, answer, meta) of one decoded record, or `BadRecord` saying what is wrong."""
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    try:
        raw_prompt = get_field(record, prompt_field)
    except BadRecord as e:
        hint = ""
        if prompt_field == "prompt" and "messages" in record:
            hint = '; a chat record? set task.prompt_field = "messages"'
        raise BadRecord(f"{e} (fields present: {', '.join(map(repr, record))}){hint}") from None
    try:
        raw_answer = get_field(record, answer_field)
    except BadRecord as e:
        raise BadRecord(f"{e} (fields present: {', '.join(map(repr, record))})") from None
    prompt = _prompt_of(raw_prompt, prompt_field)
    answer = _answer_to_str(raw_answer)
    if answer is None:
        raise BadRecord(
            f"field {answer_field!r} must be a string or a finite number, got {_short(raw_answer)}"
        )
    # A nested answer stays in meta with its parent (verl's reward_model.style, ...).
    meta = {k: v for k, v in record.items() if k not in (prompt_field, answer_field)}
    return prompt, answer, meta


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded object or BadRecord) for each non-blank line. Lines are decoded one by one, so a bad
    byte is reported on its own line."""
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a byte-order mark written by some editors
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, BadRecord(f"not valid UTF-8 (byte {e.start + 1}: {e.reason})")
                continue
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, BadRecord(f"invalid JSON ({e.msg} at column {e.colno})")


def _parquet_records(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DatasetError(
            f"{path}: reading parquet needs the pyarrow package (pip install pyarrow); or convert the file to JSONL"
        ) from e
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types for damaged files
        raise DatasetError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    row = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            row += 1
            yield row, record


def read_records(path: str | Path, fmt: str = "jsonl") -> Iterator[tuple[str, Any]]:
    """("path:line", record or BadRecord) for every record of a dataset file."""
    path = Path(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}; available: {', '.join(FORMATS)}")
    if not path.is_file():
        if not path.exists():
            raise DatasetNotFoundError(f"dataset file not found: {path}")
        raise DatasetError(f"dataset path is not a file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise DatasetError(f"cannot read dataset file {path}: {e}") from e
    if fmt == "jsonl" and magic == _PARQUET_MAGIC:
        raise DatasetError(f'{path} is a parquet file, not JSON Lines: set task.name = "parquet"')
    records = _parquet_records(path) if fmt == "parquet" else _jsonl_records(path)
    for number, record in records:
        yield f"{path}:{number}", record


def load_dataset(
    path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer", fmt: str = "jsonl"
) -> tuple[list[Example], list[str]]:
    """The good records of a dataset file as examples, and "path:line: reason" for each skipped one.

    Raises `DatasetError` (or `DatasetNotFoundError`) when the file cannot be read or holds no good record."""
    examples: list[Example] = []
    skipped: list[str] = []
    for where, record in read_records(path, fmt):
        try:
            if isinstance(record, BadRecord):
                raise record
            prompt, answer, meta = parse_record(record, prompt_field, answer_field)
        except BadRecord as e:
            skipped.append(f"{where}: {e}")
            if len(skipped) <= _MAX_LOGGED:
                logger.warning("%s: %s: record skipped", where, e)
            continue
        meta["_source"] = where
        examples.append(Example(prompt=prompt, answer=answer, meta=meta))
    if len(skipped) > _MAX_LOGGED:
        logger.warning(
            "%s: %d more bad records skipped (%d in all)", path, len(skipped) - _MAX_LOGGED, len(skipped)
        )
    if not examples:
        if not skipped:
            raise DatasetError(f"{path}: no examples (the file is empty)")
        first = "\n  ".join(skipped[:3])
        raise DatasetError(
            f"{path}: no usable record ({len(skipped)} skipped); the first:\n  {first}\n"
            "check task.prompt_field and task.answer_field"
        )
    return examples, skipped


def load_jsonl(path: str | Path, prompt_field: str = "prompt", answer_field: str = "answer") -> list[Example]:
    """The good records of a JSONL file (bad ones are skipped and logged); see `load_dataset`."""
    return load_dataset(path, prompt_field, answer_field, "jsonl")[0]


def prompt_key(prompt: str | list[dict[str, str]]) -> str:
    """A hashable identity of a prompt (a chat is a list)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


class JsonlTask:
    """Examples from a JSONL (or, with `fmt="parquet"`, a parquet) file; see the module docstring.

    `skipped` lists the bad records of both files as "path:line: reason"."""

    def __init__(
        self,
        path: str | Path,
        eval_path: str | Path | None = None,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        num_eval: int = 200,
        seed: int = 0,
        fmt: str = "jsonl",
    ) -> None:
        self.path = Path(path)
        self.name = f"{fmt}:{self.path.stem}"
        self.seed = seed
        examples, self.skipped = load_dataset(self.path, prompt_field, answer_field, fmt)
        if eval_path is not None:
            train = examples
            held_out, skipped_eval = load_dataset(eval_path, prompt_field, answer_field, fmt)
            self.skipped += skipped_eval
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
        eval_prompts = {prompt_key(ex.prompt) for ex in held_out}
        self._train = [ex for ex in train if prompt_key(ex.prompt) not in eval_prompts]
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
    def num_skipped(self) -> int:
        return len(self.skipped)

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
