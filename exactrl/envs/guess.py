"""Guess the number: a multi-turn game with no tools and no network. The environment holds a secret integer
(the example's answer); each model turn is a guess, answered "higher" or "lower" until it is found.

Reward on success: 1.0 minus 0.1 per extra guess (at least 0.1); 0.0 if the episode ends at a limit first."""

from __future__ import annotations

import re
from typing import ClassVar

from exactrl.envs.base import Environment, StepResult, Turn
from exactrl.tasks.base import Example

_INT_RE = re.compile(r"-?\d+")


class GuessNumberEnv(Environment):
    stop: ClassVar[list[str]] = ["\n"]

    def reset(self, example: Example) -> None:
        try:
            self.secret = int(example.answer.strip())
        except ValueError:
            raise ValueError(
                f"guess: the example's answer must be an integer, got {example.answer!r}"
            ) from None
        self.guesses = 0

    def step(self, turn: Turn) -> StepResult:
        m = _INT_RE.search(turn.text)
        if m is None:
            return StepResult(observation="\nSay a number.\n")
        self.guesses += 1
        guess = int(m.group())
        if guess == self.secret:
            return StepResult(done=True, reward=max(0.1, 1.0 - 0.1 * (self.guesses - 1)))
        return StepResult(observation="\nHigher.\n" if guess < self.secret else "\nLower.\n")
