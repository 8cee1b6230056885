"""What an environment is: the other side of a multi-turn episode.

An episode starts from a task `Example`: the model reads the prompt and writes a turn; the turn ends at a stop
token, a stop string (`Environment.stop`, e.g. "</calc>") or the turn's token limit. The environment then
answers with an observation (text, tokenized by the run's tokenizer, or token ids) and the model writes the next
turn on top of it, or it ends the episode with a reward. One environment object serves ONE episode (so it may
keep state); the rollout makes a new one per episode from the class (or any zero-argument factory).

Two flavours with the same shape: `Environment` (plain methods, run in a worker process that can be stopped, or
for the built-ins in a thread of the trainer's process) and `AsyncEnvironment` (coroutines, run on an event loop:
the one to use for anything that waits on I/O, e.g. a sandbox or a reward server on localhost). Either may raise
or hang: the episode then ends with reward 0 and the run goes on (exactrl.envs.rollout, "Guarding").

A custom environment::

    class Echo(Environment):
        stop = ["\\n"]

        def reset(self, example):
            self.answer = example.answer

        def step(self, turn):
            if self.answer in turn.text:
                return StepResult(done=True, reward=1.0)
            return StepResult(observation=f"Not yet (turn {turn.index + 1}). Try again:\\n")
"""

from __future__ import annotations

import functools
import inspect
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from exactrl.tasks.base import Example


@dataclass(frozen=True)
class Turn:
    """One model turn as the environment sees it.

    text: the turn's tokens decoded; token_ids: those tokens, as sampled; index: 0 for the first turn;
    finish_reason: "stop" (a stop token or stop string ended it) or "length" (the turn's token limit)."""

    text: str
    token_ids: tuple[int, ...]
    index: int
    finish_reason: str


@dataclass
class StepResult:
    """The environment's answer to a turn.

    observation: what the model reads next (text, or token ids taken as they are); ignored when done.
    done: the episode is over; reward is its reward. When the rollout stops an episode at a limit (max turns,
    max tokens) the reward of the last StepResult is the episode's, so return what an unfinished episode is
    worth (the built-ins return 0.0). tool_calls / tool_errors: counted into the run's metrics."""

    observation: str | list[int] | None = None
    done: bool = False
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0


# A worked episode: (text, written_by_model) segments in order. The model's segments are what it should write
# (their tokens are trained on), the others are the environment's observations (masked out of the loss).
Demonstration = list[tuple[str, bool]]


class Environment:
    """A synchronous environment (one instance per episode). Override `step`, and `reset` if it needs the
    example. `stop`: strings that end a model turn (added to the run's sampling.stop). `demonstration`, if
    overridden, gives the supervised warm start (sft.steps > 0) a worked episode to imitate."""

    stop: ClassVar[list[str]] = []

    def reset(self, example: Example) -> None:
        """Called once, before the first step, with the episode's example."""

    def step(self, turn: Turn) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} must implement step(turn)")

    def demonstration(self, example: Example) -> Demonstration | None:
        """A worked episode for `example` (see `Demonstration`); None = this environment has none. The SFT warm
        start tokenizes each segment on its own, as an episode's turns and observations are."""
        return None


class AsyncEnvironment:
    """An asynchronous environment: the same as `Environment` with coroutines (e.g. awaiting a local server)."""

    stop: ClassVar[list[str]] = []

    async def reset(self, example: Example) -> None:
        """Called once, before the first step, with the episode's example."""

    async def step(self, turn: Turn) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} must implement step(turn)")

    def demonstration(self, example: Example) -> Demonstration | None:
        """As `Environment.demonstration` (a plain method: building a demonstration waits on nothing)."""
        return None


EnvFactory = Callable[[], "Environment | AsyncEnvironment"]


def check_step_result(res: object) -> str | None:
    """None if `res` is a StepResult the driver can use, else what is wrong with it (the episode's error)."""
    if not isinstance(res, StepResult):
        return f"step() returned {type(res).__name__}, expected StepResult"
    r = res.reward
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        return f"reward must be a finite number, got {r!r}"
    if not res.done and res.observation is not None and not isinstance(res.observation, (str, list)):
        return f"observation must be a str or a list of token ids, got {type(res.observation).__name__}"
    return None


def env_class(make: EnvFactory) -> type | None:
    """The class a factory builds: the class itself, or a functools.partial of it; None for any other callable
    (what it builds is known only once it is called)."""
    target = make.func if isinstance(make, functools.partial) else make
    return target if isinstance(target, type) else None


def source_file(obj: Any) -> str | None:
    """The file that defines `obj` (a class, a function, a partial of either, or an instance), if Python knows it."""
    target = obj.func if isinstance(obj, functools.partial) else obj
    if not (isinstance(target, type) or inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target)
    try:
        return inspect.getsourcefile(target)
    except (TypeError, OSError):
        return None


def describe_error(e: BaseException, user_file: str | None = None) -> str:
    """'Type: message (at file:line in function)': the place is the last traceback frame in `user_file` (the
    environment's own file, so a failure inside a library the environment calls points at the environment's line
    that called it), else the last frame of all."""
    text = f"{type(e).__name__}: {e}"
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return text
    mine = [f for f in frames if user_file is not None and f.filename == user_file]
    at = (mine or frames)[-1]
    return f"{text} (at {at.filename}:{at.lineno} in {at.name})"
