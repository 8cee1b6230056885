"""A synthetic verifiable task: integer arithmetic expressions such as `12+7-3=` with answer `16`.

Prompts are deliberately terse (no prose, no spaces): the reference models are tiny and byte-tokenised, so every
character costs context and compute.

Train/eval split: each expression string is hashed (SHA-256, independent of seed and of the task's settings);
expressions whose hash falls below `eval_fraction` belong to the held-out eval set and are never yielded for
training. The split therefore holds by construction, for every seed, and the same expression lands on the same
side even if `max_operand` or `ops` change between runs.

Determinism: training example i for seed s is drawn from its own RNG seeded with `(s, i)`, so the stream is a pure
function of (settings, seed, position); resuming only needs the position, and costs O(1).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from exactrl.tasks.base import Example

SUPPORTED_OPS = ("+", "-", "*")
# Below this many distinct expressions the eval set is built by enumerating the whole eval bucket (exact, and the
# only way to know when a small space runs out); above it by rejection sampling, where duplicates are rare.
_ENUMERATE_LIMIT = 50_000
_MAX_DRAWS = 10_000  # per training example; only reached if the train bucket is (nearly) empty
_EVAL_SEED = "exactrl-arithmetic-eval"


def evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """The value of `operands[0] ops[0] operands[1] ...` with the usual precedence (`*` before `+`/`-`).

    Pure integer arithmetic: answers are computed while generating, never by evaluating a string.
    """
    if len(ops) != len(operands) - 1:
        raise ValueError(
            f"need len(ops) == len(operands) - 1, got {len(ops)} ops for {len(operands)} operands"
        )
    total = 0
    sign = 1
    term = operands[0]  # the running product of the current `*` chain
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            term *= x
        elif op in ("+", "-"):
            total += sign * term
            sign = 1 if op == "+" else -1
            term = x
        else:
            raise ValueError(f"unsupported op {op!r}; supported: {', '.join(SUPPORTED_OPS)}")
    return total + sign * term


def _is_eval(expr: str, eval_fraction: float) -> bool:
    digest = hashlib.sha256(expr.encode()).digest()
    return int.from_bytes(digest[:8], "big") < eval_fraction * 2**64


def _format(operands: Sequence[int], ops: Sequence[str]) -> str:
    parts = [str(operands[0])]
    for op, x in zip(ops, operands[1:]):
        parts.append(op)
        parts.append(str(x))
    return "".join(parts)


class ArithmeticTask:
    """Random expressions of `num_terms` integers in [min_operand, max_operand] joined by `ops`.

    prompt `"12+7-3="`, answer `"16"` (may be negative), meta `{"operands": [12, 7, 3], "ops": ["+", "-"]}`.
    """

    def __init__(
        self,
        max_operand: int = 20,
        ops: Sequence[str] = ("+", "-"),
        num_terms: int = 2,
        seed: int = 0,
        *,
        min_operand: int = 0,
        eval_fraction: float = 0.1,
    ) -> None:
        ops = tuple(ops)
        if not ops or any(op not in SUPPORTED_OPS for op in ops):
            raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, got {ops}")
        if len(set(ops)) != len(ops):
            raise ValueError(f"ops has duplicates: {ops}")
        if num_terms < 2:
            raise ValueError(f"num_terms must be >= 2, got {num_terms}")
        if min_operand < 0 or max_operand < min_operand:
            raise ValueError(f"need 0 <= min_operand <= max_operand, got [{min_operand}, {max_operand}]")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        self.name = "arithmetic"
        self.max_operand = max_operand
        self.min_operand = min_operand
        self.ops = ops
        self.num_terms = num_terms
        self.eval_fraction = eval_fraction
        self.seed = seed
        self._position = 0
        self._eval_cache: list[Example] | None = None

        self.space_size = (max_operand - min_operand + 1) ** num_terms * len(ops) ** (num_terms - 1)
        self._eval_pool: list[tuple[tuple[int, ...], tuple[str, ...]]] | None = None
        if self.space_size <= _ENUMERATE_LIMIT:
            # Small space: list the eval bucket once (also proves the train bucket is not empty).
            pool = [t for t in self._enumerate() if _is_eval(_format(*t), eval_fraction)]
            if len(pool) == self.space_size:
                raise ValueError(
                    f"all {self.space_size} expressions hash into the eval bucket; widen the operand range or "
                    "lower eval_fraction"
                )
            random.Random(_EVAL_SEED).shuffle(pool)
            self._eval_pool = pool

    # -- generation -------------------------------------------------------------------------------------------

    def _enumerate(self) -> Iterator[tuple[tuple[int, ...], tuple[str, ...]]]:
        values = range(self.min_operand, self.max_operand + 1)
        for operands in itertools.product(values, repeat=self.num_terms):
            for ops in itertools.product(self.ops, repeat=self.num_terms - 1):
                yield operands, ops

    def _draw(self, rng: random.Random) -> tuple[tuple[int, ...], tuple[str, ...]]:
        operands = tuple(rng.randint(self.min_operand, self.max_operand) for _ in range(self.num_terms))
        ops = tuple(rng.choice(self.ops) for _ in range(self.num_terms - 1))
        return operands, ops

    def _example(self, operands: Sequence[int], ops: Sequence[str], split: str) -> Example:
        expr = _format(operands, ops)
        return Example(
            prompt=expr + "=",
            answer=str(evaluate(operands, ops)),
            meta={"operands": list(operands), "ops": list(ops), "split": split},
        )

    def train_example(self, seed: int, position: int) -> Example:
        """Training example number `position` of the stream for `seed` (random access; the stream is pure)."""
        rng = random.Random(f"exactrl-arithmetic-train:{seed}:{position}")
        for _ in range(_MAX_DRAWS):
            operands, ops = self._draw(rng)
            if not _is_eval(_format(operands, ops), self.eval_fraction):
                return self._example(operands, ops, "train")
        raise RuntimeError(f"no training expression found in {_MAX_DRAWS} draws; lower eval_fraction")

    def train_examples(self, seed: int | None = None) -> Iterator[Example]:
        """Endless training stream from the cursor. A seed other than the cursor's restarts at position 0.

        The generator reads and advances the task's cursor on every step, so `load_state_dict` takes effect even
        on an iterator that is already live (and two live iterators share one stream).
        """
        if seed is not None and seed != self.seed:
            self.seed = seed
            self._position = 0
        while True:
            example = self.train_example(self.seed, self._position)
            # Advance before yielding: an example counts as consumed once handed out, so a checkpoint taken right
            # after does not replay it.
            self._position += 1
            yield example

    def eval_examples(self, num: int | None = None) -> list[Example]:
        """The first `num` examples of the fixed held-out set; None means up to 200 (fewer if the space is small).

        Asking for more than a small expression space holds warns and returns all of them.
        """
        explicit = num is not None
        num = 200 if num is None else num
        if num < 0:
            raise ValueError(f"num must be >= 0, got {num}")
        if self._eval_cache is None or len(self._eval_cache) < num:
            self._eval_cache = self._build_eval(num)
        if explicit and len(self._eval_cache) < num:
            warnings.warn(
                f"arithmetic task has only {len(self._eval_cache)} held-out expressions "
                f"(space {self.space_size}, eval_fraction {self.eval_fraction}); asked for {num}",
                stacklevel=2,
            )
        return list(self._eval_cache[:num])

    def _build_eval(self, num: int) -> list[Example]:
        if self._eval_pool is not None:
            return [self._example(operands, ops, "eval") for operands, ops in self._eval_pool]
        # Large space: sample with a fixed seed and keep distinct eval-bucket expressions, in draw order, so a
        # shorter list is always a prefix of a longer one.
        rng = random.Random(_EVAL_SEED)
        seen: set[str] = set()
        out: list[Example] = []
        for _ in range(max(num, 1) * 1000):
            if len(out) >= num:
                break
            operands, ops = self._draw(rng)
            expr = _format(operands, ops)
            if expr not in seen and _is_eval(expr, self.eval_fraction):
                seen.add(expr)
                out.append(self._example(operands, ops, "eval"))
        return out

    # -- resume -----------------------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "min_operand": self.min_operand,
            "max_operand": self.max_operand,
            "ops": list(self.ops),
            "num_terms": self.num_terms,
            "eval_fraction": self.eval_fraction,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "position": self._position, "config": self._config()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor. Refuses a state from a task with other settings: its positions mean other problems."""
        config = state.get("config")
        if config is not None and config != self._config():
            raise ValueError(
                f"arithmetic task state was saved with settings {config}, this task has {self._config()}"
            )
        self.seed = int(state["seed"])
        self._position = int(state["position"])
