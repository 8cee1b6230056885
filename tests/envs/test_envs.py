"""The environment interface: the built-in environments, guarding against bad ones (raise, hang, garbage;
sync and async), metrics, the [env] config keys, and token ids that are the engine's, never a re-tokenization."""

import asyncio
import functools
import sys
import time
from fractions import Fraction

import pytest
import torch
from sample_envs import (
    BusyLoop,
    Counter,
    FixedObservation,
    Flaky,
    Garbage,
    NaNReward,
    Parser,
    broken_factory,
)
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from exactrl.config import ConfigError, RunConfig
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.envs import (
    AsyncEnvironment,
    EnvSetup,
    EpisodeSettings,
    StepResult,
    Turn,
    resolve_env,
    run_episodes,
)
from exactrl.envs.calculator import CalcError, CalculatorEnv, calculate, format_number
from exactrl.envs.guess import GuessNumberEnv
from exactrl.envs.rollout import env_report
from exactrl.envs.workers import EnvWorkerPool, EnvWorkerStartError
from exactrl.model import build_model, preset
from exactrl.model.tokenizer import byte_tokenizer
from exactrl.tasks.base import Example
from exactrl.train.packing import masked_completion_logprobs


def _turn(text, i=0):
    return Turn(text, tuple(text.encode()), i, "stop")


def test_calculator_tool_calls_and_final_answer():
    assert calculate("12*7") == 84 and calculate("(1+2)*-3") == -9 and calculate("7/2") == Fraction(7, 2)
    assert format_number(Fraction(7, 2)) == "3.5" and format_number(Fraction(1, 3)) == "0.333333333333"
    for bad in ("9**9", "__import__('os')", "2+", "1/0", "x", "9" * 40 + "*" + "9" * 40):
        with pytest.raises(CalcError):
            calculate(bad)
    env = CalculatorEnv()
    env.reset(Example("What is 17*23?", "391"))
    r = env.step(_turn("I'll compute <calc>17*23</calc>"))
    assert r == StepResult(observation="<result>391</result>", tool_calls=1)
    r = env.step(_turn("<calc>17**23</calc>", 1))
    assert r.observation.startswith("<result>error:") and r.tool_errors == 1 and not r.done
    assert env.step(_turn("The answer is 391", 2)) == StepResult(done=True, reward=1.0)
    assert env.step(_turn("The answer is 390", 3)).reward == 0.0
    assert CalculatorEnv.stop == ["</calc>"]


def test_guess_game():
    env = GuessNumberEnv()
    env.reset(Example("guess", "42"))
    assert env.step(_turn("hmm")).observation == "\nSay a number.\n"
    assert env.step(_turn("10")).observation == "\nHigher.\n"
    assert env.step(_turn("50")).observation == "\nLower.\n"
    assert env.step(_turn("42")) == StepResult(done=True, reward=0.8)
    assert resolve_env("guess") is GuessNumberEnv and resolve_env("calculator") is CalculatorEnv
    assert resolve_env("exactrl.envs.guess:GuessNumberEnv") is GuessNumberEnv
    with pytest.raises(ValueError, match="env.name: unknown environment 'nope'"):
        resolve_env("nope")
    with pytest.raises(ValueError, match="not a subclass"):
        resolve_env("exactrl.tasks.base:Example")


# -- end to end on the engine ----------------------------------------------------------------------------------
_MODEL = {}


def _engine(tok=None):
    if "m" not in _MODEL:
        _MODEL["m"] = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0)
    return RolloutEngine(_MODEL["m"], EngineConfig(num_kv_blocks=64), tokenizer=tok or byte_tokenizer())


def _run(
    make_env,
    n_prompts=2,
    n=2,
    timeout_s=5.0,
    max_turns=3,
    tok=None,
    temperature=1.0,
    examples=None,
    pool=None,
    progress=None,
    **kw,
):
    eng = _engine(tok)
    tok = eng.tokenizer
    examples = examples or [Example(f"Q{i}:", str(i)) for i in range(n_prompts)]
    prompts = [tok.encode(e.prompt) for e in examples]
    settings = EpisodeSettings(
        max_turns=max_turns, max_tokens_per_turn=6, max_episode_tokens=96, timeout_s=timeout_s, **kw
    )
    params = SamplingParams(temperature=temperature, n=n, seed=1)
    return eng, run_episodes(
        eng, tok, examples, prompts, make_env, settings, params, pool=pool, progress=progress
    )


class AsyncCounter(AsyncEnvironment):
    async def reset(self, example):
        self.turns = 0

    async def step(self, turn):
        await asyncio.sleep(0.001)  # a real await: the answer comes back on the event loop
        self.turns += 1
        return StepResult(observation="ok " * self.turns, reward=float(self.turns))


def test_sync_and_async_envs_run_several_turns():
    for env, reward, obs_len in ((Counter, 0.75, [1, 2]), (AsyncCounter, 3.0, [3, 6])):
        _, b = _run(env)
        eps = [e for g in b.groups for e in g]
        assert len(eps) == 4
        for e in eps:
            assert e.finish_reason == "max_turns" and e.num_turns == 3 and e.reward == reward
            assert [t - s for s, t in e.observations] == obs_len
            assert [t - s for s, t in e.turns] == [6, 6, 6]
        assert b.metrics["env/turns_mean"] == 3.0 and b.metrics["env/errors"] == 0
        assert b.metrics["env/observation_tokens_mean"] == sum(obs_len)
        assert b.metrics["env/episode_tokens_mean"] == 18 + sum(obs_len)
    assert b.metrics["env/finish_max_turns"] == 4


class AsyncHang(AsyncEnvironment):
    async def step(self, turn):
        await asyncio.sleep(60)  # cancelled at the timeout


def test_a_bad_environment_ends_its_episode_with_reward_zero_and_the_run_goes_on():
    t0 = time.perf_counter()
    _, b = _run(AsyncHang, timeout_s=0.2)
    assert time.perf_counter() - t0 < 10
    assert all(e.finish_reason == "env_timeout" and e.reward == 0.0 for g in b.groups for e in g)
    assert b.metrics["env/timeouts"] == 4
    for env, reason in (
        (Garbage, "StepResult"),
        (NaNReward, "finite"),
        (broken_factory, "sandbox unavailable"),
    ):
        _, b = _run(env)
        assert all(e.finish_reason == "env_error" and reason in e.error for g in b.groups for e in g)
        assert b.metrics["env/errors"] == 4
    # One episode crashes or hangs, the others complete their turns (sampling makes which one does what).
    _, b = _run(Flaky, timeout_s=0.5, temperature=1.0)
    first = b.groups[0]
    assert {e.finish_reason for e in first} <= {"env_error", "env_timeout"} and all(
        e.reward == 0 for e in first
    )
    assert all(e.finish_reason == "max_turns" and e.num_turns == 3 for e in b.groups[1])
    m = b.metrics
    assert m["env/errors"] + m["env/timeouts"] == 2 and m["env/finish_max_turns"] == 2


def test_the_trainer_gets_the_engines_ids_not_a_retokenization():
    """The byte tokenizer has no merges, yet decoding then encoding a sampled conversation does not give its ids
    back (a random model writes bytes that are not UTF-8, and ids the tokenizer has no text for). A BPE with one
    merge shows the other case: a turn that ends in "a" before an observation starting with "b" re-encodes as the
    merged "ab". The episode carries the engine's ids, and those score bitwise equal to the rollout."""
    eng, b = _run(Counter, temperature=1.0)
    eps = [e for g in b.groups for e in g]
    tok = eng.tokenizer
    retok = [tok.encode(tok.decode(e.completion_ids)) for e in eps]
    assert any(r != e.completion_ids for r, e in zip(retok, eps))
    lps = masked_completion_logprobs(
        eng.model,
        [e.token_ids for e in eps],
        [len(e.prompt_ids) for e in eps],
        [e.loss_mask for e in eps],
        1.0,
    )
    assert all(torch.equal(a, e.rollout_logprobs) for a, e in zip(lps, eps))

    bpe = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    turn_ids, obs_ids = bpe.encode("a").ids, bpe.encode("b").ids  # as the engine appends them: one by one
    assert turn_ids + obs_ids == [0, 1] and bpe.encode(
        bpe.decode(turn_ids + obs_ids).replace(" ", "")
    ).ids == [2]


def test_env_config_section():
    cfg = RunConfig()
    cfg.model.preset = "tiny"
    cfg.env.name = "calculator"
    cfg.env.max_episode_tokens = 100_000
    with pytest.raises(ConfigError, match=r"engine.max_model_len.*env.max_episode_tokens"):
        cfg.validate()
    cfg = RunConfig()
    cfg.model.preset = "tiny"
    cfg.env.name = "chess"
    with pytest.raises(ConfigError, match="env.name"):
        cfg.validate()
    cfg = RunConfig()
    cfg.model.preset = "tiny"
    cfg.env.timeout_s = 0
    with pytest.raises(ConfigError, match="env.timeout_s"):
        cfg.validate()


# -- synchronous environments in worker processes ----------------------------------------------------------------
def _beats(path) -> int:
    return int(path.read_text()) if path.exists() else 0


@pytest.mark.parametrize("workers", [4, 1])
def test_a_busy_looping_sync_env_is_stopped_within_its_timeout_and_the_run_goes_on(tmp_path, workers):
    """One episode's second call spins forever (pure Python, no I/O). It ends at env.timeout_s (plus the
    engine step that notices), counted as a timeout, not an error; its worker process is killed, so the loop
    stops running (a thread would spin, and take the GIL, until the process ends). With a worker per episode the
    other episodes finish; with one worker for all, the episodes it held end with it (reward 0, timeouts)."""
    beat = tmp_path / "beat"
    examples = [Example("Q0:", "spin", {"beat": str(beat)}), Example("Q1:", "1")]
    timeout = 0.5
    t0 = time.perf_counter()
    _, b = _run(BusyLoop, n=2, timeout_s=timeout, examples=examples, workers=workers)
    assert time.perf_counter() - t0 < 30  # the episodes' whole run; the spinning call alone never ends
    spun = [e for e in b.groups[0] if e.num_turns == 2]  # both samples of prompt 0 spin at their second call
    assert len(spun) == 2
    for e in spun:
        assert e.finish_reason == "env_timeout" and e.reward == 0.0 and e.env_calls == 2
        assert "took more than 0.5 s" in e.error or "lost with its worker" in e.error
    # The step that hung returned within its limit plus a little: the engine step that noticed, and on a loaded
    # machine the worker's queue and the kill (the call's clock starts at dispatch).
    hung = [e for e in spun if "took more than 0.5 s" in e.error]  # the others were lost with its worker
    assert hung and all(timeout <= e.last_call_s < timeout + 2.0 for e in hung)
    assert all(e.last_call_s < timeout + 2.0 for e in spun)
    # The spinning code is dead (a thread would spin on): its heartbeat file stops changing.
    n = _beats(beat)
    assert n > 0
    time.sleep(0.3)
    assert _beats(beat) == n
    m = b.metrics
    assert m["env/errors"] == 0 and m["env/timeouts"] == 2 + (2 if workers == 1 else 0)
    assert m["env/workers_stopped"] >= 1
    if workers == 4:
        assert all(e.finish_reason == "max_turns" and e.reward == 3.0 for e in b.groups[1])
    else:  # the other episodes of the stopped worker lost their environment with it
        assert all(
            e.finish_reason == "env_timeout" and "lost with its worker" in e.error for e in b.groups[1]
        )
    # The run goes on: the next batch of episodes works.
    _, b = _run(BusyLoop, n=2, timeout_s=timeout, workers=workers)
    assert b.metrics["env/finish_max_turns"] == 4


def test_environment_errors_say_where_and_a_failing_environment_is_loud():
    """An exception's text names the file and line in the environment's own module (the last traceback frame
    there), in the worker process and in a thread alike; env_report prints the first one, and warns when the
    share of failed calls passes env.max_error_share."""
    import sample_envs

    line = next(i for i, x in enumerate(open(sample_envs.__file__), 1) if "return int(json.loads(text))" in x)
    where = f"{sample_envs.__file__}:{line} in _parse"
    for isolation in ("process", "thread"):
        _, b = _run(Parser, isolation=isolation, max_error_share=0.5)
        for e in (e for g in b.groups for e in g):
            assert e.finish_reason == "env_error" and e.error.startswith("JSONDecodeError: ")
            assert e.error.endswith(f"(at {where})"), e.error
        assert b.metrics["env/calls"] == 4 and b.metrics["env/error_share"] == 1.0
        settings = EpisodeSettings(max_error_share=0.5)
        lines = env_report(b, settings)
        assert lines[0].startswith("environment errors: 4 of 4 calls; first: episode (request ")
        assert where in lines[0] and "WARNING" in lines[1] and "env.max_error_share = 0.5" in lines[1]
    _, b = _run(Counter)
    assert env_report(b, EpisodeSettings()) == [] and b.metrics["env/error_share"] == 0.0


def test_timed_out_environment_calls_count_toward_the_error_share():
    """An environment step that runs past env.timeout_s fails as surely as one that raises: it counts in
    env/error_share, and past env.max_error_share the step's report warns."""
    from sample_envs import SlowStep

    examples = [Example("Q0:", "slow"), Example("Q1:", "1"), Example("Q2:", "2")]
    _, b = _run(SlowStep, n=2, timeout_s=0.3, examples=examples, isolation="process", workers=6)
    assert all(e.finish_reason == "env_timeout" and e.reward == 0.0 for e in b.groups[0])
    assert all(e.finish_reason == "max_turns" for g in b.groups[1:] for e in g)
    m = b.metrics
    # A call is reset with the first step, then one per step: prompt 0's 2 episodes made 1 call each (timed out),
    # the other 4 episodes 3 each.
    assert m["env/timeouts"] == 2 and m["env/errors"] == 0 and m["env/calls"] == 2 + 4 * 3
    assert m["env/error_share"] == 2 / 14
    lines = env_report(b, EpisodeSettings())  # env.max_error_share's default, 0.1
    assert lines[0].startswith("environment timeouts: 2 of 14 calls; first: ")
    assert len(lines) == 2 and "WARNING: the environment failed on 14% of its calls" in lines[1]
    assert "env.max_error_share = 0.1" in lines[1]
    assert len(env_report(b, EpisodeSettings(max_error_share=0.15))) == 1  # below the share: no warning


def test_where_calls_run_and_what_cannot_go_to_a_worker(tmp_path):
    from exactrl.envs.rollout import isolation_of

    assert (
        isolation_of(CalculatorEnv, "auto") == "thread" and isolation_of(GuessNumberEnv, "auto") == "thread"
    )
    assert isolation_of(Counter, "auto") == "process" and isolation_of(broken_factory, "auto") == "process"
    assert isolation_of(functools.partial(FixedObservation, length=2), "auto") == "process"
    assert isolation_of(CalculatorEnv, "process") == "process" and isolation_of(Counter, "thread") == "thread"
    assert isolation_of(AsyncCounter, "process") == "thread"  # on the event loop, where a timeout cancels
    with pytest.raises(ValueError, match="cannot be sent to a worker process.*env.isolation = 'thread'"):
        _run(lambda: Counter())
    # A module the worker cannot import (not on the sys.path it gets) is said, not scored 0 quietly.
    (tmp_path / "gone_env.py").write_text(
        "from exactrl.envs import Environment\nclass Gone(Environment):\n    pass\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        from gone_env import Gone

        pool = EnvWorkerPool(Gone, 1, sys_path=[p for p in sys.path if p != str(tmp_path)])
        pool.call((0, 0), _turn("x"), 5.0, example=Example("p", "a"), first=True)
        with pytest.raises(EnvWorkerStartError, match="No module named 'gone_env'"):
            for _ in range(100):  # the worker says so once it starts
                pool.pump(1.0)
        pool.close()
    finally:
        sys.path.remove(str(tmp_path))


def test_the_worker_processes_are_kept_across_calls_and_replaced_after_a_hang():
    """EnvSetup.pool: the run's workers start once, not every step; a worker stopped for a hung call is replaced
    in the next call; an exception out of run_episodes stops the workers that still hold episodes."""
    setup = EnvSetup(BusyLoop, BusyLoop, EpisodeSettings(workers=2))
    assert EnvSetup(CalculatorEnv, CalculatorEnv, EpisodeSettings()).pool() is None  # in this process
    pool = setup.pool()
    assert setup.pool() is pool
    _, b = _run(BusyLoop, pool=pool, workers=2)
    pids = set(pool.pids())
    assert len(pids) == 2 and b.metrics["env/finish_max_turns"] == 4 and pool.num_episodes == 0
    _, b = _run(BusyLoop, pool=pool, workers=2)
    assert set(pool.pids()) == pids and b.metrics["env/workers_stopped"] == 0
    spin = [Example("Q0:", "spin"), Example("Q1:", "1")]
    _, b = _run(BusyLoop, pool=pool, workers=2, timeout_s=0.5, examples=spin)
    assert b.metrics["env/workers_stopped"] >= 1 and b.metrics["env/timeouts"] >= 2
    assert len(set(pool.pids()) & pids) <= 1  # the stopped one is gone
    _, b = _run(BusyLoop, pool=pool, workers=2)
    assert b.metrics["env/finish_max_turns"] == 4 and pool.num_workers == 2

    def interrupted(n):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(BusyLoop, pool=pool, workers=2, examples=spin, progress=interrupted)
    assert pool.num_workers == 0 and pool.num_episodes == 0


# -- the episode token cap counts the observations ---------------------------------------------------------------
def test_the_token_cap_counts_every_observation():
    """prompt + model turns + observations <= env.max_episode_tokens. An observation that leaves room for one
    more model token is appended and the next turn gets just that token; one that would leave none ends the
    episode ("max_tokens") without being appended. Turns are 6 tokens, observations 5."""
    eng = _engine()
    tok = eng.tokenizer
    ex = Example("Q0:", "0")
    P = len(tok.encode(ex.prompt))
    make = functools.partial(FixedObservation, length=5)
    params = SamplingParams(temperature=1.0, n=3, seed=2)

    def run(cap):
        # In this process: the cap is the driver's and the engine's business, wherever the environment runs.
        settings = EpisodeSettings(
            max_turns=5, max_tokens_per_turn=6, max_episode_tokens=cap, isolation="thread"
        )
        return [
            e
            for g in run_episodes(eng, tok, [ex], [tok.encode(ex.prompt)], make, settings, params).groups
            for e in g
        ]

    for cap, completion, turns, obs, reward in (
        (
            P + 6 + 5 + 1,
            12,
            [(0, 6), (11, 12)],
            [(6, 11)],
            2.0,
        ),  # the observation fits with one token to spare
        (P + 6 + 5, 6, [(0, 6)], [], 1.0),  # it would fill the cap: the episode ends before it
        (P + 6 + 5 + 6 + 5 + 3, 25, [(0, 6), (11, 17), (22, 25)], [(6, 11), (17, 22)], 3.0),
    ):
        eps = run(cap)
        assert len(eps) == 3
        for e in eps:
            assert len(e.token_ids) == P + completion <= cap
            assert e.turns == turns and e.observations == obs
            assert e.finish_reason == "max_tokens" and e.reward == reward
            assert sum(e.loss_mask) == sum(t - s for s, t in turns)
