"""Episodes: the engine's multi-turn generation (exactrl.engine.turns) driven by environments.

    run_episodes(engine, tokenizer, examples, prompt_ids, make_env, settings, params) -> EpisodeBatch

Each prompt gets params.n episodes (a GRPO group: they share the prompt's KV blocks, then diverge). Between
engine steps the driver hands every ended turn to its episode's environment (in a worker process, a worker
thread, or on an event loop for an `AsyncEnvironment`), and resumes the episode with the observation's token ids
as soon as the answer is back, while the other episodes keep decoding. Nothing waits for a turn round (on one
engine; an engine split over ranks goes in rounds, "Lockstep" below).

What an episode returns (`Episode`) is what the engine saw: the prompt ids, then the completion (model turns and
observations, in order), a loss mask (True at sampled tokens, False at observation tokens), the rollout logprob
of each sampled token (0.0 at observation tokens), the turn boundaries, the reward and why it ended. Its ids are
never a re-tokenization of the decoded conversation.

The token cap. prompt + every model turn + every observation <= settings.max_episode_tokens: a turn samples at
most what is left, and an observation that would leave no room for one more model token ends the episode
("max_tokens", with the reward of the step that returned it) instead of being appended: a truncated observation
would show the model text the environment never wrote.

Guarding. Every environment call (reset + the first step, then each step) has `settings.timeout_s` (the first
call twice that). A call that raises, returns something other than a `StepResult`, or a non-finite reward ends
its episode with reward 0 ("env_error", its text with the file and line in the environment that raised); one
that runs past its time ends it with reward 0 ("env_timeout"); both are counted in the metrics and the run goes
on. Where a call runs (`settings.isolation`):
- a synchronous environment from outside exactrl ("auto", or "process"): in a worker process
  (exactrl.envs.workers), an episode pinned to one; a call past its time has its worker killed, so a busy loop
  stops within the limit; the other episodes of that worker end too (their environments died with it);
- the built-in environments (calculator, guess) under "auto", or any with "thread": in a daemon thread per call,
  in the trainer's process. They answer in microseconds and cannot hang (the calculator caps the size of what it
  computes), so they need no guard a thread cannot give, and skip the workers' start (measured on 2 shared CPU
  cores, 64 calculator episodes: 0.15 s in threads; in processes 1.25 s for the first call, which starts 4
  workers, then 0.15 s once `EnvSetup.pool` keeps them). A thread cannot be stopped: a call past its time is
  abandoned, and one that busy-loops keeps taking the GIL;
- an `AsyncEnvironment`: on one event loop thread, where a call past its time is cancelled. A coroutine that
  blocks without awaiting cannot be cancelled: write async environments that await.

Lockstep (`Lockstep`: an engine split over a group of ranks, exactrl/distributed/shared_engine.py and the generator
groups of exactrl/train/disagg.py). Every forward of a split engine is a collective over its group, so every rank
must step it with the same scheduler state in the same order; the schedule above depends on when answers arrive,
which differs between ranks. In lockstep every rank of the group runs the union of the group's episodes in its
engine, and each episode's environment is called by one rank, its owner. The loop goes in rounds: the engine steps
until nothing is runnable (the same step on every rank); an owner calls an episode's environment as soon as its turn
ends (the call overlaps the round's other decoding) and decides what the answer means (end, or resume with the
observation's ids) when it is back; at the round's end the owners wait for their last answers, one `gather` trades
every owner's decisions, and every rank applies all of them in one order, by (request id, sample index). Timeouts are
decided by the owner alone, so a slow environment ends its episode on every rank at once. The tokens and logprobs
of an episode are the ones of a run without lockstep (batch-invariant engine, sampling keyed by request and sample);
the price is the turn round: an episode whose answer is back waits for the round's last turn to end before it
resumes. A rank keeps (and reports progress, metrics and failures for) the episodes it owns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from exactrl.engine.engine import RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.engine.sequence import Sequence
from exactrl.engine.turns import TurnSession
from exactrl.envs.base import (
    AsyncEnvironment,
    Environment,
    StepResult,
    Turn,
    check_step_result,
    describe_error,
    env_class,
    source_file,
)
from exactrl.envs.registry import builtin_envs
from exactrl.envs.workers import EnvCallError, EnvCallTimeout, EnvWorkerPool
from exactrl.tasks.base import Example


@dataclass
class EpisodeSettings:
    """The limits of an episode (the [env] config section's numbers)."""

    max_turns: int = 4
    max_tokens_per_turn: int = 64
    max_episode_tokens: int = 1024
    timeout_s: float = 30.0
    isolation: str = "auto"  # "auto", "process" or "thread": where sync calls run (module docstring)
    workers: int = 4  # worker processes of the "process" isolation
    max_error_share: float = 0.1  # more failed calls than this share: `env_report` warns

    def validate(self) -> EpisodeSettings:
        for name in ("max_turns", "max_tokens_per_turn", "max_episode_tokens", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EpisodeSettings.{name} must be an int >= 1, got {v!r}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"EpisodeSettings.timeout_s must be > 0, got {self.timeout_s!r}")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"EpisodeSettings.isolation must be one of {ISOLATIONS}, got {self.isolation!r}")
        if not (isinstance(self.max_error_share, (int, float)) and 0 <= self.max_error_share <= 1):
            raise ValueError(
                f"EpisodeSettings.max_error_share must be in [0, 1], got {self.max_error_share!r}"
            )
        return self


ISOLATIONS = ("auto", "process", "thread")


@dataclass
class EnvSetup:
    """What runs episodes of one environment: its class (its `stop` strings), a zero-argument factory (one
    instance per episode, `env_factory`) and the limits."""

    cls: type
    make: Callable[[], Environment | AsyncEnvironment]
    settings: EpisodeSettings
    _pool: EnvWorkerPool | None = field(default=None, init=False, repr=False)

    def pool(self) -> EnvWorkerPool | None:
        """The environment's worker processes, kept from one `run_episodes` call to the next (a worker's start,
        a fresh interpreter importing the environment's module, costs about 0.1 to 0.3 s: once per run, not per
        step); None where its calls run in this process. They stop when this object goes, or with the process."""
        if isolation_of(self.make, self.settings.isolation) != "process":
            return None
        if self._pool is None:
            self._pool = EnvWorkerPool(self.make, self.settings.workers)
            weakref.finalize(self, self._pool.close)
        return self._pool


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
    env_calls: int = 0
    last_call_s: float = 0.0  # the last environment call, from its submission to its answer (or its end)

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
    reason is errors[i]); metrics: `episode_metrics` of all of them; cache: `TurnSession.cache_stats`;
    first_failures: the first "env_error" and the first "env_timeout" of the call, as text naming the episode (an
    error's text has the file and line in the environment that raised)."""

    groups: list[list[Episode]]
    errors: list[str | None]
    metrics: dict[str, float] = field(default_factory=dict)
    cache: dict[str, int] = field(default_factory=dict)
    first_failures: dict[str, str] = field(default_factory=dict)


@dataclass
class Lockstep:
    """How one rank of a split engine takes part in its group's episodes (module docstring, "Lockstep").

    gather: every rank's picklable object, in rank order (`TensorParallelGroup.gather_objects`); owned[i]: whether
    this rank calls prompt i's environment and keeps its episodes (exactly one rank of the group owns each prompt;
    `examples[i]` of a prompt it does not own is never read, None will do)."""

    gather: Callable[[Any], list[Any]]
    owned: list[bool]


@dataclass
class _Verdict:
    """What an environment call means for its episode: resume with `observation` (token ids), or, None, end it
    (`reason`, `reward`, `error`)."""

    observation: list[int] | None
    reason: str = ""
    reward: float = 0.0
    error: str | None = None


# ---------------------------------------------------------------------------------------------------------------
# Running environment calls off the engine's thread
# ---------------------------------------------------------------------------------------------------------------
class _Caller:
    """Runs environment calls off the engine's thread: in worker processes (`pool`), in a daemon thread each, or
    on one event loop thread (async environments)."""

    def __init__(self, pool: EnvWorkerPool | None, own_pool: bool) -> None:
        self.pool, self.own_pool = pool, own_pool
        self._loop: asyncio.AbstractEventLoop | None = None

    def coroutine(self, fn: Callable[[], Any], timeout_s: float) -> cf.Future:
        loop = self._event_loop()
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(fn(), timeout_s), loop)

    def thread(self, fn: Callable[[], Any]) -> cf.Future:
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

    def poll(self) -> None:
        """Collect the answers of worker processes that are back (and stop hung ones); no wait."""
        if self.pool is not None:
            self.pool.pump(0.0)

    def wait(self, futures: list[cf.Future], timeout: float) -> None:
        """Until one of `futures` is done or `timeout` seconds pass (math.inf: no limit)."""
        if self.pool is not None:
            self.pool.wait(futures, timeout)
        else:
            cf.wait(futures, timeout=None if math.isinf(timeout) else timeout, return_when=cf.FIRST_COMPLETED)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="exactrl-env-loop", daemon=True).start()
        return self._loop

    def close(self) -> None:
        # A shared pool is kept for the next call, unless this one ended early (an exception) with episodes
        # still in its workers: then its workers are stopped too (the pool starts fresh ones when asked).
        if self.pool is not None and (self.own_pool or self.pool.num_episodes):
            self.pool.close()
        if self._loop is not None:
            loop = self._loop
            for task in asyncio.all_tasks(loop):  # hung coroutines: cancel, never wait for them
                loop.call_soon_threadsafe(task.cancel)
            loop.call_soon_threadsafe(loop.stop)
            self._loop = None


def isolation_of(make_env: Callable[[], Environment | AsyncEnvironment], isolation: str) -> str:
    """Where a factory's sync calls run: "process" or "thread" (see the module docstring). An AsyncEnvironment
    class runs on the event loop whatever the setting ("thread": in this process)."""
    cls = env_class(make_env)
    if cls is not None and issubclass(cls, AsyncEnvironment):
        return "thread"
    if isolation == "auto":
        return "thread" if cls is not None and cls in builtin_envs().values() else "process"
    return isolation


@dataclass
class _Run:
    """One episode in flight."""

    example: Example | None  # None: a prompt another rank owns (lockstep)
    env: Environment | AsyncEnvironment | None = None
    seq: Sequence | None = None
    turns: list[tuple[int, int]] = field(default_factory=list)  # absolute positions in seq.token_ids
    call: cf.Future | None = None
    deadline: float = 0.0
    t_call: float = 0.0
    last_call_s: float = 0.0
    env_time_s: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    started: bool = False
    calls: int = 0


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
    pool: EnvWorkerPool | None = None,
    lockstep: Lockstep | None = None,
) -> EpisodeBatch:
    """params.n episodes per example (see the module docstring). params.max_tokens is replaced by
    settings.max_tokens_per_turn; params.stop should hold the environment's `stop` strings (`env_stop`).
    `progress(k)` is called as k more episodes end. pool: worker processes to keep across calls
    (`EnvSetup.pool`); without one, a sync environment that runs in processes gets a pool for this call.
    lockstep: this rank's part in a split engine's episodes (module docstring); the batch then holds the prompts
    this rank owns, in order."""
    settings.validate()
    if len(examples) != len(prompt_ids):
        raise ValueError(f"got {len(examples)} examples for {len(prompt_ids)} prompts")
    owned = [True] * len(prompt_ids) if lockstep is None else list(lockstep.owned)
    if len(owned) != len(prompt_ids):
        raise ValueError(f"lockstep: {len(owned)} owners for {len(prompt_ids)} prompts")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    params = SamplingParams(**{**params.__dict__, "max_tokens": settings.max_tokens_per_turn})
    # A factory that cannot go to a worker process is refused here, before any token is sampled.
    own_pool = pool is None and any(owned) and isolation_of(make_env, settings.isolation) == "process"
    if own_pool:
        pool = EnvWorkerPool(make_env, settings.workers)
    session = TurnSession(engine, prompt_ids, params, settings.max_episode_tokens, request_ids)
    by_req = {rid: i for i, rid in enumerate(session.request_ids)}
    # The requests whose environments run here (all of them, but in lockstep).
    mine = {rid for rid, o in zip(session.request_ids, owned) if o}
    runs: dict[tuple[int, int], _Run] = {}
    decided: dict[tuple[int, int], _Verdict] = {}  # lockstep: this round's verdicts, applied at its end
    done: dict[tuple[int, int], Episode] = {}
    first_failures: dict[str, str] = {}
    caller = _Caller(pool, own_pool)
    killed_before = 0 if pool is None else pool.num_killed
    timeout = float(settings.timeout_s)
    factory_file = source_file(make_env)

    def end(key: tuple[int, int], run: _Run, reason: str, reward: float, error: str | None = None) -> None:
        seq = run.seq
        assert seq is not None
        if seq.is_paused:
            session.release(seq, reason)
        if key[0] not in mine:  # another rank of the group keeps it (lockstep)
            return
        if pool is not None and run.started:
            pool.end(key)
        if error is not None and reason in ("env_error", "env_timeout") and reason not in first_failures:
            first_failures[reason] = f"episode (request {key[0]}, sample {key[1]}), call {run.calls}: {error}"
        done[key] = _episode(seq, run, reason, reward, error)
        if progress is not None:
            progress(1)

    def call_env(key: tuple[int, int], run: _Run, turn: Turn) -> None:
        first = not run.started
        run.started = True
        run.calls += 1
        run.t_call = time.perf_counter()
        limit = 2 * timeout if first else timeout  # reset + the first step are one call: each has timeout_s
        if pool is not None:
            # The pool keeps the clock: a call may wait behind another episode's on the same worker.
            run.call = pool.call(key, turn, limit, example=run.example, first=first)
            run.deadline = math.inf
            return
        env, example = run.env, run.example
        assert env is not None
        if isinstance(env, AsyncEnvironment):

            async def async_job() -> StepResult:
                if first:
                    assert example is not None  # an episode's first call carries its example
                    await asyncio.wait_for(env.reset(example), timeout)
                return await asyncio.wait_for(env.step(turn), timeout)

            run.call = caller.coroutine(async_job, limit)
        else:

            def job() -> StepResult:
                if first:
                    assert example is not None  # an episode's first call carries its example
                    env.reset(example)
                return env.step(turn)

            run.call = caller.thread(job)
        run.deadline = run.t_call + limit

    def on_turn_end(seq: Sequence) -> None:
        key = (seq.request_id, seq.sample_index)
        run = runs.get(key)
        if run is None:  # the episode's first turn (a fork child is a new Sequence object)
            run = runs[key] = _Run(examples[by_req[seq.request_id]])
        run.seq = seq
        if seq.is_finished:  # refused by the engine (outgrew the KV cache): the same on every rank of a group
            end(key, run, seq.finish_reason or "error", 0.0, seq.finish_reason)
            return
        run.turns.append((seq.turn_start, seq.num_tokens))
        if key[0] not in mine:  # its owner calls the environment; the verdict comes at the round's end
            return
        ids = seq.turn_token_ids
        turn = Turn(
            tokenizer.decode(ids) if tokenizer is not None else "",
            tuple(ids),
            len(run.turns) - 1,
            seq.finish_reason or "length",
        )
        if run.env is None and pool is None:  # in this process (a worker process builds its own)
            try:
                run.env = make_env()
            except Exception as e:  # noqa: BLE001
                error = f"making the environment: {describe_error(e, factory_file)}"
                settle(key, run, _Verdict(None, "env_error", 0.0, error))
                return
        call_env(key, run, turn)

    def on_answer(key: tuple[int, int], run: _Run) -> _Verdict:
        """What the environment's answer (or its absence past the deadline) means for the episode."""
        fut, run.call = run.call, None
        assert fut is not None and run.seq is not None
        run.last_call_s = time.perf_counter() - run.t_call
        run.env_time_s += run.last_call_s
        if not fut.done():  # a thread or a coroutine past its deadline (the pool answers its own)
            fut.cancel()
            return _Verdict(None, "env_timeout", 0.0, f"environment call took more than {timeout:g} s")
        try:
            res = fut.result()
        except EnvCallTimeout as e:
            return _Verdict(None, "env_timeout", 0.0, str(e))
        except (TimeoutError, asyncio.TimeoutError):
            return _Verdict(None, "env_timeout", 0.0, f"environment call took more than {timeout:g} s")
        except EnvCallError as e:  # described in the worker, with the place in the environment's file
            return _Verdict(None, "env_error", 0.0, str(e))
        except BaseException as e:  # noqa: BLE001
            return _Verdict(None, "env_error", 0.0, describe_error(e, source_file(run.env) or factory_file))
        problem = check_step_result(res)
        if problem is not None:
            return _Verdict(None, "env_error", 0.0, problem)
        run.tool_calls += int(res.tool_calls)
        run.tool_errors += int(res.tool_errors)
        reward = float(res.reward)
        if res.done:
            return _Verdict(None, "done", reward)
        if len(run.turns) >= settings.max_turns:
            return _Verdict(None, "max_turns", reward)
        obs = res.observation
        if obs is None:
            obs_ids: list[int] = []
        elif isinstance(obs, str):
            obs_ids = tokenizer.encode(obs) if obs else []
        else:
            obs_ids = list(obs)
        vocab = engine.model.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in obs_ids):
            return _Verdict(None, "env_error", 0.0, f"observation token ids must be ints in [0, {vocab})")
        # The cap counts the observation: it must leave room for at least one more model token, else the
        # episode ends here, the observation not appended (module docstring, "The token cap").
        if run.seq.num_tokens + len(obs_ids) + 1 > session.max_total_tokens:
            return _Verdict(None, "max_tokens", reward)
        return _Verdict(obs_ids)

    def apply(key: tuple[int, int], run: _Run, verdict: _Verdict) -> None:
        if verdict.observation is None:
            end(key, run, verdict.reason, verdict.reward, verdict.error)
        else:
            assert run.seq is not None
            session.resume(run.seq, verdict.observation, settings.max_tokens_per_turn)

    def settle(key: tuple[int, int], run: _Run, verdict: _Verdict) -> None:
        """Alone, a verdict applies at once; in lockstep it waits for the round's end (`trade`)."""
        if lockstep is None:
            apply(key, run, verdict)
        else:
            decided[key] = verdict

    def answered_calls(now: float) -> list[tuple[tuple[int, int], _Run]]:
        return [
            (k, r) for k, r in runs.items() if r.call is not None and (r.call.done() or now >= r.deadline)
        ]

    def trade() -> None:
        """Lockstep, nothing runnable: wait for this rank's last answers, trade every owner's verdicts, apply them
        all in (request id, sample index) order. Every paused episode then has been resumed or ended."""
        assert lockstep is not None
        while waiting := [r for r in runs.values() if r.call is not None]:
            caller.poll()
            now = time.perf_counter()
            answered = answered_calls(now)
            if not answered:
                caller.wait(
                    [r.call for r in waiting if r.call is not None],
                    max(0.0, min(r.deadline for r in waiting) - now),
                )
            for k, r in answered:
                decided[k] = on_answer(k, r)
        ours = dict(decided)
        decided.clear()
        told = [(k, v.observation, v.reason) for k, v in ours.items()]
        for k, obs, reason in sorted((x for part in lockstep.gather(told) for x in part), key=lambda x: x[0]):
            apply(k, runs[k], ours[k] if k in ours else _Verdict(obs, reason))
        # The next round would wait for a verdict no owner sends: fail rather than hang.
        if session.num_paused:
            raise RuntimeError(f"lockstep: no rank of the group decided {session.num_paused} paused episodes")

    try:
        while True:
            ran = session.step()
            for seq in session.take_turn_ends():
                on_turn_end(seq)
            caller.poll()
            now = time.perf_counter()
            answered = answered_calls(now)
            for k, r in answered:
                settle(k, r, on_answer(k, r))
            if ran:
                continue
            if lockstep is not None:  # the round's end: the same step on every rank of the group
                if not session.num_paused:
                    break  # every episode has ended
                trade()
                continue
            if answered:
                continue
            waiting = [r for r in runs.values() if r.call is not None]
            if not waiting:
                break  # nothing runs, nothing is asked: every episode has ended
            # Every episode waits for its environment: sleep until the first answer or deadline.
            caller.wait(
                [r.call for r in waiting if r.call is not None],
                max(0.0, min(r.deadline for r in waiting) - now),
            )
    finally:
        caller.close()
        session.close()
    for k, r in runs.items():  # cannot happen: every paused episode is resumed or ended above
        if k[0] in mine and k not in done:
            raise RuntimeError(f"episode {k} was left unfinished ({r.seq})")
    groups: list[list[Episode]] = [[] for _ in prompt_ids]
    for (rid, _j), ep in sorted(done.items()):
        groups[by_req[rid]].append(ep)
    keep = [i for i, o in enumerate(owned) if o]
    groups = [groups[i] for i in keep]
    episodes = [e for g in groups for e in g]
    metrics = episode_metrics(episodes)
    if pool is not None and metrics:
        metrics["env/workers_stopped"] = float(pool.num_killed - killed_before)
    errors = [session.errors[i] for i in keep]
    return EpisodeBatch(groups, errors, metrics, session.cache_stats(), first_failures)


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
        env_calls=run.calls,
        last_call_s=run.last_call_s,
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
    calls = sum(e.env_calls for e in episodes)
    failed = reasons.get("env_error", 0) + reasons.get("env_timeout", 0)
    m = {
        "env/episodes": float(n),
        "env/turns_mean": sum(e.num_turns for e in episodes) / n,
        "env/turns_max": float(max(e.num_turns for e in episodes)),
        "env/tool_calls": float(sum(e.tool_calls for e in episodes)),
        "env/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "env/tool_errors": float(sum(e.tool_errors for e in episodes)),
        "env/tool_errors_mean": sum(e.tool_errors for e in episodes) / n,
        "env/calls": float(calls),
        "env/errors": float(reasons.get("env_error", 0)),
        "env/timeouts": float(reasons.get("env_timeout", 0)),
        # Every failure ends its episode, so each failed call is one error or one timeout.
        "env/error_share": failed / calls if calls else 0.0,
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


# How `episode_metrics` of several ranks' episodes combine into the step's (`combine_episode_metrics`): counts add,
# maxima take the largest, means are per episode (weighted by each rank's env/episodes) and shares are recomputed.
_EPISODE_MAXIMA = ("env/turns_max", "env/episode_tokens_max")
# Means of whole numbers per episode: each rank's sum is mean * episodes, a whole number, recovered exactly.
_EPISODE_COUNT_MEANS = (
    "env/turns_mean",
    "env/tool_calls_mean",
    "env/tool_errors_mean",
    "env/observation_tokens_mean",
    "env/model_tokens_mean",
    "env/episode_tokens_mean",
)


def combine_episode_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The step's `episode_metrics` from every rank's (each over its own episodes; an empty dict for a rank without
    any): what one process running every episode would log. A rank's non-environment keys (e.g. dynamic_sampling/*,
    the same on every rank) are taken from the first rank that has them."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    if len(parts) == 1:
        return dict(parts[0])
    # episodes over the ranks that ran any (a single-turn run's parts hold only its non-environment keys, e.g.
    # dynamic sampling's, and no env/* key that would need this count)
    n = sum(p.get("env/episodes", 0) for p in parts)
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        present = [p for p in parts if key in p]
        if not key.startswith("env/"):
            out[key] = present[0][key]
        elif key in _EPISODE_MAXIMA:
            out[key] = max(p[key] for p in present)
        elif key in _EPISODE_COUNT_MEANS:
            out[key] = sum(round(p[key] * p["env/episodes"]) for p in present) / n
        elif key == "env/time_s_mean":
            out[key] = sum(p["env/time_s"] for p in present) / n
        elif key == "env/error_share":
            continue  # below, from the summed failures and calls
        else:  # counts: episodes, calls, tool calls, errors, timeouts, finish reasons, seconds, stopped workers
            out[key] = float(sum(p[key] for p in present))
    if "env/error_share" in out or any("env/error_share" in p for p in parts):
        calls = out.get("env/calls", 0.0)
        failed = out.get("env/errors", 0.0) + out.get("env/timeouts", 0.0)
        out["env/error_share"] = failed / calls if calls else 0.0
    return out


def env_report(batch: EpisodeBatch, settings: EpisodeSettings) -> list[str]:
    """Lines for the run's log about environment failures: the first error and the first timeout (with where the
    environment raised), and a warning when more than settings.max_error_share of the calls failed."""
    m = batch.metrics
    lines = []
    for reason, what in (("env_error", "errors"), ("env_timeout", "timeouts")):
        if reason in batch.first_failures:
            n = int(m.get(f"env/{what}", 0))
            lines.append(
                f"environment {what}: {n} of {int(m.get('env/calls', 0))} calls; first: "
                f"{batch.first_failures[reason]}"
            )
    share = m.get("env/error_share", 0.0)
    if share > settings.max_error_share:
        lines.append(
            f"WARNING: the environment failed on {share:.0%} of its calls, more than env.max_error_share = "
            f"{settings.max_error_share:g}: those episodes end with reward 0 and teach nothing; fix the "
            "environment (its first failure is above) or raise env.timeout_s"
        )
    return lines


def env_stop(params_stop: list[str], env_cls: type) -> list[str]:
    """The run's stop strings plus the environment's (in order, no repeats)."""
    out: list[str] = []
    for s in list(params_stop) + list(getattr(env_cls, "stop", [])):
        if s not in out:
            out.append(s)
    return out
