"""Episodes: the engine's multi-turn generation (exactrl.engine.turns) driven by environments.

    run_episodes(engine, tokenizer, examples, prompt_ids, make_env, settings, params) -> EpisodeBatch

Each prompt gets params.n episodes (a GRPO group: they share the prompt's KV blocks, then diverge). Between
engine steps the driver hands every ended turn to its episode's environment (in a worker thread, or on an event
loop for an `AsyncEnvironment`), and resumes the episode with the observation's token ids as soon as the answer
is back, while the other episodes keep decoding. Nothing waits for a turn round.

What an episode returns (`Episode`) is what the engine saw: the prompt ids, then the completion (model turns and
observations, in order), a loss mask (True at sampled tokens, False at observation tokens), the rollout logprob
of each sampled token (0.0 at observation tokens), the turn boundaries, the reward and why it ended. Its ids are
never a re-tokenization of the decoded conversation.

Guarding. Every environment call (reset, step) has `settings.timeout_s`. A call that raises, returns something
other than a `StepResult`, or a non-finite reward ends its episode with reward 0 ("env_error"); one that runs
past its time ends it with reward 0 ("env_timeout"); both are counted in the metrics and the run goes on. An
async call past its time is cancelled on the event loop. A sync call cannot be stopped (Python cannot kill a
thread): each sync call runs in a daemon thread of its own, and a call past its time is abandoned (its result,
if it ever comes, is ignored; the thread ends with the process). An environment that hangs for good thus leaks
one idle thread per hung call: prefer an AsyncEnvironment for anything that can hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from exactrl.engine.engine import RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.engine.sequence import Sequence
from exactrl.engine.turns import TurnSession
from exactrl.envs.base import AsyncEnvironment, Environment, StepResult, Turn
from exactrl.tasks.base import Example


@dataclass
class EpisodeSettings:
    """The limits of an episode (the [env] config section's numbers)."""

    max_turns: int = 4
    max_tokens_per_turn: int = 64
    max_episode_tokens: int = 1024
    timeout_s: float = 30.0

    def validate(self) -> EpisodeSettings:
        for name in ("max_turns", "max_tokens_per_turn", "max_episode_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EpisodeSettings.{name} must be an int >= 1, got {v!r}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"EpisodeSettings.timeout_s must be > 0, got {self.timeout_s!r}")
        return self


@dataclass
class EnvSetup:
    """What runs episodes of one environment: its class (its `stop` strings), a zero-argument factory (one
    instance per episode, `env_factory`) and the limits."""

    cls: type
    make: Callable[[], Environment | AsyncEnvironment]
    settings: EpisodeSettings


@dataclass
class Episode:
    """One episode as the trainer needs it.

    completion_ids: everything after the prompt (model turns and observations), the engine's ids;
    loss_mask: [len(completion_ids)] True at sampled tokens; rollout_logprobs: [len(completion_ids)] fp32, the
    recorded logprob of each sampled token, 0.0 at observation tokens; turns / observations: [start, end) of each
    model turn / observation in completion_ids; finish_reason: "done" (the environment ended it), "max_turns",
    "max_tokens", "env_error", "env_timeout", or "error: ..." (the engine refused it)."""

    request_id: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[bool]
    rollout_logprobs: torch.Tensor
    turns: list[tuple[int, int]]
    observations: list[tuple[int, int]]
    reward: float
    finish_reason: str
    tool_calls: int = 0
    tool_errors: int = 0
    env_time_s: float = 0.0
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        """prompt + completion: the sequence the trainer scores."""
        return self.prompt_ids + self.completion_ids

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_observation_tokens(self) -> int:
        return sum(e - s for s, e in self.observations)


@dataclass
class EpisodeBatch:
    """groups[i]: the episodes of prompt i in sample order (empty if the engine refused the prompt, whose
    reason is errors[i]); metrics: `episode_metrics` of all of them; cache: `TurnSession.cache_stats`."""

    groups: list[list[Episode]]
    errors: list[str | None]
    metrics: dict[str, float] = field(default_factory=dict)
    cache: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# Running environment calls off the engine's thread
# ---------------------------------------------------------------------------------------------------------------
class _Caller:
    """Runs environment calls: sync ones in a daemon thread each, async ones on one event loop thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def submit(self, fn: Callable[[], Any], is_async: bool, timeout_s: float) -> cf.Future:
        if is_async:
            loop = self._event_loop()
            return asyncio.run_coroutine_threadsafe(asyncio.wait_for(fn(), timeout_s), loop)
        fut: cf.Future = cf.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - any failure of the environment ends its episode
                fut.set_exception(e)

        threading.Thread(target=run, name="exactrl-env", daemon=True).start()
        return fut

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="exactrl-env-loop", daemon=True).start()
        return self._loop

    def close(self) -> None:
        if self._loop is not None:
            loop = self._loop
            for task in asyncio.all_tasks(loop):  # hung coroutines: cancel, never wait for them
                loop.call_soon_threadsafe(task.cancel)
            loop.call_soon_threadsafe(loop.stop)
            self._loop = None


@dataclass
class _Run:
    """One episode in flight."""

    example: Example
    env: Environment | AsyncEnvironment | None = None
    seq: Sequence | None = None
    turns: list[tuple[int, int]] = field(default_factory=list)  # absolute positions in seq.token_ids
    call: cf.Future | None = None
    deadline: float = 0.0
    t_call: float = 0.0
    env_time_s: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    started: bool = False


def run_episodes(
    engine: RolloutEngine,
    tokenizer: Any,
    examples: list[Example],
    prompt_ids: list[list[int]],
    make_env: Callable[[], Environment | AsyncEnvironment],
    settings: EpisodeSettings,
    params: SamplingParams,
    request_ids: list[int] | None = None,
    progress: Callable[[int], object] | None = None,
) -> EpisodeBatch:
    """params.n episodes per example (see the module docstring). params.max_tokens is replaced by
    settings.max_tokens_per_turn; params.stop should hold the environment's `stop` strings (`env_stop`).
    `progress(k)` is called as k more episodes end."""
    settings.validate()
    if len(examples) != len(prompt_ids):
        raise ValueError(f"got {len(examples)} examples for {len(prompt_ids)} prompts")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    params = SamplingParams(**{**params.__dict__, "max_tokens": settings.max_tokens_per_turn})
    session = TurnSession(engine, prompt_ids, params, settings.max_episode_tokens, request_ids)
    by_req = {rid: i for i, rid in enumerate(session.request_ids)}
    runs: dict[tuple[int, int], _Run] = {}
    done: dict[tuple[int, int], Episode] = {}
    caller = _Caller()
    timeout = float(settings.timeout_s)

    def end(key: tuple[int, int], run: _Run, reason: str, reward: float, error: str | None = None) -> None:
        seq = run.seq
        assert seq is not None
        if seq.is_paused:
            session.release(seq, reason)
        done[key] = _episode(seq, run, reason, reward, error)
        if progress is not None:
            progress(1)

    def call_env(run: _Run, turn: Turn) -> None:
        env = run.env
        assert env is not None
        is_async = isinstance(env, AsyncEnvironment)
        first = not run.started
        run.started = True
        if is_async:

            async def job() -> StepResult:
                if first:
                    await asyncio.wait_for(env.reset(run.example), timeout)
                return await asyncio.wait_for(env.step(turn), timeout)

            fut = caller.submit(job, True, 2 * timeout if first else timeout)
        else:

            def job() -> StepResult:
                if first:
                    env.reset(run.example)
                return env.step(turn)

            fut = caller.submit(job, False, timeout)
        run.call = fut
        run.t_call = time.perf_counter()
        # reset + the first step are one job: each has timeout_s
        run.deadline = run.t_call + (2 * timeout if first else timeout)

    def on_turn_end(seq: Sequence) -> None:
        key = (seq.request_id, seq.sample_index)
        run = runs.get(key)
        if run is None:  # the episode's first turn (a fork child is a new Sequence object)
            run = runs[key] = _Run(examples[by_req[seq.request_id]])
        run.seq = seq
        if seq.is_finished:  # refused by the engine (outgrew the KV cache)
            end(key, run, seq.finish_reason or "error", 0.0, seq.finish_reason)
            return
        run.turns.append((seq.turn_start, seq.num_tokens))
        ids = seq.turn_token_ids
        turn = Turn(
            tokenizer.decode(ids) if tokenizer is not None else "",
            tuple(ids),
            len(run.turns) - 1,
            seq.finish_reason or "length",
        )
        if run.env is None:
            try:
                run.env = make_env()
            except Exception as e:  # noqa: BLE001
                end(key, run, "env_error", 0.0, f"making the environment: {type(e).__name__}: {e}")
                return
        call_env(run, turn)

    def on_answer(key: tuple[int, int], run: _Run) -> None:
        fut, run.call = run.call, None
        assert fut is not None and run.seq is not None
        run.env_time_s += time.perf_counter() - run.t_call
        if not fut.done():
            fut.cancel()
            end(key, run, "env_timeout", 0.0, f"environment call took more than {timeout:g} s")
            return
        try:
            res = fut.result()
        except (TimeoutError, asyncio.TimeoutError):
            end(key, run, "env_timeout", 0.0, f"environment call took more than {timeout:g} s")
            return
        except BaseException as e:  # noqa: BLE001
            end(key, run, "env_error", 0.0, f"{type(e).__name__}: {e}")
            return
        problem = _check_result(res)
        if problem is not None:
            end(key, run, "env_error", 0.0, problem)
            return
        run.tool_calls += int(res.tool_calls)
        run.tool_errors += int(res.tool_errors)
        reward = float(res.reward)
        if res.done:
            end(key, run, "done", reward)
            return
        if len(run.turns) >= settings.max_turns:
            end(key, run, "max_turns", reward)
            return
        obs = res.observation
        if obs is None:
            obs_ids: list[int] = []
        elif isinstance(obs, str):
            obs_ids = tokenizer.encode(obs) if obs else []
        else:
            obs_ids = list(obs)
        vocab = engine.model.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in obs_ids):
            end(key, run, "env_error", 0.0, f"observation token ids must be ints in [0, {vocab})")
            return
        if run.seq.num_tokens + len(obs_ids) + 1 > session.max_total_tokens:
            end(key, run, "max_tokens", reward)
            return
        session.resume(run.seq, obs_ids, settings.max_tokens_per_turn)

    try:
        while True:
            ran = session.step()
            for seq in session.take_turn_ends():
                on_turn_end(seq)
            waiting = [(k, r) for k, r in runs.items() if r.call is not None]
            now = time.perf_counter()
            answered = [(k, r) for k, r in waiting if r.call.done() or now >= r.deadline]
            if not answered and not ran:
                if not waiting:
                    break  # nothing runs, nothing is asked: every episode has ended
                # Every episode waits for its environment: sleep until the first answer or deadline.
                cf.wait(
                    [r.call for _, r in waiting],
                    timeout=max(0.0, min(r.deadline for _, r in waiting) - now),
                    return_when=cf.FIRST_COMPLETED,
                )
                continue
            for k, r in answered:
                on_answer(k, r)
    finally:
        caller.close()
        session.close()
    for k, r in runs.items():  # cannot happen: every paused episode is resumed or ended above
        if k not in done:
            raise RuntimeError(f"episode {k} was left unfinished ({r.seq})")
    groups: list[list[Episode]] = [[] for _ in prompt_ids]
    for (rid, _j), ep in sorted(done.items()):
        groups[by_req[rid]].append(ep)
    episodes = [e for g in groups for e in g]
    return EpisodeBatch(groups, list(session.errors), episode_metrics(episodes), session.cache_stats())


def _check_result(res: object) -> str | None:
    if not isinstance(res, StepResult):
        return f"step() returned {type(res).__name__}, expected StepResult"
    r = res.reward
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        return f"reward must be a finite number, got {r!r}"
    if not res.done and res.observation is not None and not isinstance(res.observation, (str, list)):
        return f"observation must be a str or a list of token ids, got {type(res.observation).__name__}"
    return None


def _episode(seq: Sequence, run: _Run, reason: str, reward: float, error: str | None) -> Episode:
    p = seq.num_prompt_tokens
    completion = list(seq.token_ids[p:])
    mask = [True] * len(completion)
    obs = [(s - p, e - p) for s, e in seq.observation_spans]
    for s, e in obs:
        mask[s:e] = [False] * (e - s)
    lp = torch.zeros(len(completion), dtype=torch.float32)
    where = torch.tensor(mask, dtype=torch.bool)
    if int(where.sum()) != len(seq.rollout_logprobs):  # the bookkeeping of turns and observations broke
        raise RuntimeError(
            f"episode ({seq.request_id}, {seq.sample_index}): {int(where.sum())} sampled tokens but "
            f"{len(seq.rollout_logprobs)} rollout logprobs"
        )
    lp[where] = torch.tensor(seq.rollout_logprobs, dtype=torch.float32)
    return Episode(
        request_id=seq.request_id,
        sample_index=seq.sample_index,
        prompt_ids=list(seq.token_ids[:p]),
        completion_ids=completion,
        loss_mask=mask,
        rollout_logprobs=lp,
        turns=[(s - p, e - p) for s, e in run.turns],
        observations=obs,
        reward=float(reward),
        finish_reason=reason,
        tool_calls=run.tool_calls,
        tool_errors=run.tool_errors,
        env_time_s=run.env_time_s,
        error=error,
    )


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Turns, tool calls and errors, environment failures and time, observation and episode tokens."""
    if not episodes:
        return {}
    n = len(episodes)
    reasons: dict[str, int] = {}
    for e in episodes:
        r = "engine_error" if e.finish_reason.startswith("error") else e.finish_reason
        reasons[r] = reasons.get(r, 0) + 1
    m = {
        "env/episodes": float(n),
        "env/turns_mean": sum(e.num_turns for e in episodes) / n,
        "env/turns_max": float(max(e.num_turns for e in episodes)),
        "env/tool_calls": float(sum(e.tool_calls for e in episodes)),
        "env/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "env/tool_errors": float(sum(e.tool_errors for e in episodes)),
        "env/tool_errors_mean": sum(e.tool_errors for e in episodes) / n,
        "env/errors": float(reasons.get("env_error", 0)),
        "env/timeouts": float(reasons.get("env_timeout", 0)),
        "env/time_s": sum(e.env_time_s for e in episodes),
        "env/time_s_mean": sum(e.env_time_s for e in episodes) / n,
        "env/observation_tokens_mean": sum(e.num_observation_tokens for e in episodes) / n,
        "env/model_tokens_mean": sum(sum(e.loss_mask) for e in episodes) / n,
        "env/episode_tokens_mean": sum(len(e.completion_ids) for e in episodes) / n,
        "env/episode_tokens_max": float(max(len(e.completion_ids) for e in episodes)),
    }
    for r, c in sorted(reasons.items()):
        m[f"env/finish_{r}"] = float(c)
    return m


def env_stop(params_stop: list[str], env_cls: type) -> list[str]:
    """The run's stop strings plus the environment's (in order, no repeats)."""
    out: list[str] = []
    for s in list(params_stop) + list(getattr(env_cls, "stop", [])):
        if s not in out:
            out.append(s)
    return out
