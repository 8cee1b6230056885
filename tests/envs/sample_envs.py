"""Environments for the tests, in a module of their own: a worker process imports an environment's module by
name, and this one imports neither torch nor the engine, so a worker starts in a fraction of a second."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from exactrl.envs import Environment, StepResult


class Counter(Environment):
    """Observations as token ids, of a length growing with the turn; a reward of 0.25 per turn."""

    def reset(self, example):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        return StepResult(observation=[65] * self.turns, reward=0.25 * self.turns, tool_calls=1)


class Flaky(Environment):
    """Sample 0 of prompt 0 raises at its second turn, sample 1 of prompt 0 hangs there; prompt 1 is fine."""

    def reset(self, example):
        self.q, self.turns = example.answer, 0

    def step(self, turn):
        self.turns += 1
        if self.q == "0" and self.turns == 2:
            if turn.token_ids[0] % 2 == 0:
                raise RuntimeError("tool crashed")
            time.sleep(3.0)  # past the timeout: its worker is stopped
        return StepResult(observation="x")


class SlowStep(Environment):
    """The episodes of a prompt whose answer is "slow" hang at their first step (stopped at the timeout); the others
    run like Counter."""

    def reset(self, example):
        self.q, self.turns = example.answer, 0

    def step(self, turn):
        if self.q == "slow":
            time.sleep(60)
        self.turns += 1
        return StepResult(observation=[65], reward=1.0)


class Garbage(Environment):
    def step(self, turn):
        return {"observation": "not a StepResult"}


class NaNReward(Environment):
    def step(self, turn):
        return StepResult(done=True, reward=float("nan"))


def broken_factory():
    raise OSError("sandbox unavailable")


def _parse(text: str) -> int:
    # Raises inside the json module for a turn that is not a number; the error's place is still this line: the
    # last frame in the environment's own file.
    return int(json.loads(text))


class Parser(Environment):
    """Raises at the first step (a random model writes no number), in a library its helper calls."""

    def step(self, turn):
        return StepResult(observation=str(_parse(turn.text + "?")))


class BusyLoop(Environment):
    """Prompt "spin" busy-loops at its second call without ever returning (no sleep, no I/O: only killing
    its process stops it), counting its iterations into the file named by example.meta["beat"]; other prompts
    answer at once. Reward 1.0 per answered turn."""

    def reset(self, example):
        self.spin = example.answer == "spin"
        self.beat = example.meta.get("beat")
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        if self.spin and self.turns == 2:
            n = 0
            while True:
                n += 1
                if n % 200_000 == 0 and self.beat:  # written whole (a kill may come mid-write)
                    tmp = f"{self.beat}.{os.getpid()}.{threading.get_ident()}"
                    Path(tmp).write_text(str(n))
                    os.replace(tmp, self.beat)
        return StepResult(observation=[66, 67], reward=float(self.turns))


class FixedObservation(Environment):
    """Answers every turn with `length` token ids; the reward is the number of turns answered."""

    def __init__(self, length: int = 4) -> None:
        self.length = length

    def reset(self, example):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        return StepResult(observation=[70 + self.turns] * self.length, reward=float(self.turns))


class VaryingReward(Environment):
    """Two model turns with a 5-token observation between them; the reward is a function of every token the
    model wrote (so it varies within a group, and GRPO's advantages are not zero)."""

    def reset(self, example):
        self.written: list[int] = []

    def step(self, turn):
        self.written += list(turn.token_ids)
        if turn.index == 0:
            return StepResult(observation=[80, 81, 82, 83, 84])
        return StepResult(done=True, reward=(sum(self.written) % 7) / 6)


class EndsOnEvenToken(Environment):
    """Ends the episode ("done") after the first turn when the model's first token is even; otherwise answers every
    turn with an observation, so the episode runs until env.max_turns cuts it."""

    def reset(self, example):
        pass

    def step(self, turn):
        if turn.index == 0 and turn.token_ids and turn.token_ids[0] % 2 == 0:
            return StepResult(done=True, reward=1.0)
        return StepResult(observation=[90, 91], reward=0.5)
