"""The environment interface: the built-in environments, guarding against bad ones (raise, hang, garbage;
sync and async), metrics, the [env] config keys, and token ids that are the engine's, never a re-tokenization."""

import asyncio
import time
from fractions import Fraction

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from exactrl.config import ConfigError, RunConfig
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.envs import (
    AsyncEnvironment,
    Environment,
    EpisodeSettings,
    StepResult,
    Turn,
    resolve_env,
    run_episodes,
)
from exactrl.envs.calculator import CalcError, CalculatorEnv, calculate, format_number
from exactrl.envs.guess import GuessNumberEnv
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


def _run(make_env, n_prompts=2, n=2, timeout_s=5.0, max_turns=3, tok=None, temperature=1.0):
    eng = _engine(tok)
    tok = eng.tokenizer
    examples = [Example(f"Q{i}:", str(i)) for i in range(n_prompts)]
    prompts = [tok.encode(e.prompt) for e in examples]
    settings = EpisodeSettings(
        max_turns=max_turns, max_tokens_per_turn=6, max_episode_tokens=96, timeout_s=timeout_s
    )
    params = SamplingParams(temperature=temperature, n=n, seed=1)
    return eng, run_episodes(eng, tok, examples, prompts, make_env, settings, params)


class Counter(Environment):
    """Observations as token ids, of a length growing with the turn; a reward of 0.25 per turn."""

    def reset(self, example):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        return StepResult(observation=[65] * self.turns, reward=0.25 * self.turns, tool_calls=1)


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


class Flaky(Environment):
    """Sample 0 of prompt 0 raises at its second turn, sample 1 of prompt 0 hangs there; prompt 1 is fine."""

    def reset(self, example):
        self.q, self.turns = example.answer, 0

    def step(self, turn):
        self.turns += 1
        if self.q == "0" and self.turns == 2:
            if turn.token_ids[0] % 2 == 0:
                raise RuntimeError("tool crashed")
            time.sleep(3.0)  # abandoned after the timeout; the thread finishes on its own
        return StepResult(observation="x")


class AsyncHang(AsyncEnvironment):
    async def step(self, turn):
        await asyncio.sleep(60)  # cancelled at the timeout


class Garbage(Environment):
    def step(self, turn):
        return {"observation": "not a StepResult"}


class NaNReward(Environment):
    def step(self, turn):
        return StepResult(done=True, reward=float("nan"))


def _broken_factory():
    raise OSError("sandbox unavailable")


def test_a_bad_environment_ends_its_episode_with_reward_zero_and_the_run_goes_on():
    t0 = time.perf_counter()
    _, b = _run(AsyncHang, timeout_s=0.2)
    assert time.perf_counter() - t0 < 10
    assert all(e.finish_reason == "env_timeout" and e.reward == 0.0 for g in b.groups for e in g)
    assert b.metrics["env/timeouts"] == 4
    for env, reason in (
        (Garbage, "StepResult"),
        (NaNReward, "finite"),
        (_broken_factory, "sandbox unavailable"),
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
