"""What the calculator recipe (configs/quickstart-tools.toml) is made of: the calculator's worked episodes and
episode-level reward options, a supervised warm start on transcripts whose observations are masked out of the
loss, and a held-out evaluation that runs each example as an episode through the environment."""

from __future__ import annotations

import pytest
import torch

from exactrl.config import ConfigError, RunConfig
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.envs import Environment, EnvSetup, EpisodeSettings, StepResult, Turn, env_factory
from exactrl.envs.calculator import CalculatorEnv
from exactrl.envs.guess import GuessNumberEnv
from exactrl.model import build_model, preset
from exactrl.model.tokenizer import byte_tokenizer
from exactrl.tasks.base import Example
from exactrl.tasks.prompts import PromptEncoder
from exactrl.train.loop import evaluate
from exactrl.train.optim import MasterAdamW
from exactrl.train.packing import masked_completion_logprobs
from exactrl.train.sft import demonstration_tokens, sft_step


def _turn(text: str, i: int = 0) -> Turn:
    return Turn(text, tuple(text.encode()), i, "stop")


def test_calculator_demonstration_and_episode_rewards():
    env = CalculatorEnv()
    ex = Example("47*23=", "1081")
    assert env.demonstration(ex) == [
        ("<calc>47*23</calc>", True),
        ("<result>1081</result>", False),
        ("1081", True),
    ]
    # A record may name its expression; a prompt that is not one is refused, naming the record.
    assert env.demonstration(Example("How much is 6 times 7?", "42", {"expression": "6*7"}))[1][0] == (
        "<result>42</result>"
    )
    with pytest.raises(ValueError, match="data.jsonl:3"):
        env.demonstration(Example("How much is 6 times 7?", "42", {"_source": "data.jsonl:3"}))
    # The reward depends on the whole episode: correctness, the number of calls, the final answer's format.
    env = CalculatorEnv(call_cost=0.1, format_penalty=0.25)
    env.reset(ex)
    assert env.step(_turn("<calc>47*23</calc>")).tool_calls == 1
    assert env.step(_turn("<calc>1081*1</calc>", 1)).tool_calls == 1
    assert env.step(_turn("1081", 2)).reward == pytest.approx(0.8)
    env.reset(ex)
    assert env.step(_turn("so it is 1081")).reward == pytest.approx(0.75)  # no call, but more than a number
    with pytest.raises(ValueError, match="call_cost must be a number in"):
        CalculatorEnv(call_cost=-1)
    assert GuessNumberEnv().demonstration(ex) is None  # no worked episode: the warm start learns the answers


def test_demo_call_share_answers_the_rest_directly_the_same_way_every_time():
    """The recipe's warm start calls the calculator on half the problems and answers the others directly, so
    the warm-started policy sometimes skips the tool and RL has a choice to learn."""
    exs = [Example(f"{a}*{b}=", str(a * b)) for a in range(10, 40) for b in range(10, 20)]  # 300 problems
    half = CalculatorEnv(demo_call_share=0.5)
    demos = [half.demonstration(ex) for ex in exs]
    calls = [d for d in demos if len(d) == 3]
    direct = [(d, ex) for d, ex in zip(demos, exs) if len(d) != 3]
    assert 0.4 < len(calls) / len(exs) < 0.6
    assert all(d == [(ex.answer, True)] for d, ex in direct)
    assert all(d[0][0].startswith("<calc>") for d in calls)
    # Decided by the problem, not by the call: a new instance (another worker, a resumed run) agrees.
    assert [CalculatorEnv(demo_call_share=0.5).demonstration(ex) for ex in exs] == demos
    assert all(len(CalculatorEnv(demo_call_share=1.0).demonstration(ex)) == 3 for ex in exs)
    assert all(len(CalculatorEnv(demo_call_share=0.0).demonstration(ex)) == 1 for ex in exs)
    # A smaller share calls on a subset of the larger share's problems.
    quarter = {ex.prompt for ex in exs if len(CalculatorEnv(demo_call_share=0.25).demonstration(ex)) == 3}
    assert quarter < {ex.prompt for ex, d in zip(exs, demos) if len(d) == 3}
    with pytest.raises(ValueError, match="demo_call_share must be a number in"):
        CalculatorEnv(demo_call_share=1.5)


def test_env_options_are_checked_by_name():
    cls, make = env_factory("calculator", {"call_cost": 0.05})
    assert cls is CalculatorEnv and make().call_cost == 0.05
    with pytest.raises(ValueError, match="env.options: 'calculator' \\(CalculatorEnv\\) does not take"):
        env_factory("calculator", {"cost": 0.05})
    with pytest.raises(ValueError, match="env.options: calculator: format_penalty"):
        env_factory("calculator", {"format_penalty": 3})
    cfg = RunConfig()
    cfg.model.preset = "tiny"
    cfg.env.options = {"call_cost": 0.1}
    with pytest.raises(ConfigError, match="env.options"):
        cfg.validate()  # options without an environment


def test_sft_on_a_worked_episode_learns_the_model_turns_only():
    tok = byte_tokenizer()
    segs = CalculatorEnv().demonstration(Example("47*23=", "1081"))
    ids, mask = demonstration_tokens(tok, segs)
    # Each segment on its own (as the engine appends turns and observations), then end-of-sequence, learned.
    assert ids == tok.encode("<calc>47*23</calc>") + tok.encode("<result>1081</result>") + tok.encode(
        "1081"
    ) + [tok.eos_token_id]
    assert mask == [True] * 18 + [False] * 21 + [True] * 5
    torch.manual_seed(0)
    model = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0)
    prompts = [tok.encode("47*23="), tok.encode("9*8=")]
    other_ids, other_mask = demonstration_tokens(tok, CalculatorEnv().demonstration(Example("9*8=", "72")))
    comps, masks = [ids, other_ids], [mask, other_mask]
    # The loss is the mean NLL of the model's tokens alone (computed apart, before the step changes weights).
    lps = masked_completion_logprobs(model, [p + c for p, c in zip(prompts, comps)], [6, 4], masks)
    n = sum(sum(m) for m in masks)
    expected = -sum(float(lp.sum()) for lp in lps) / n
    m = sft_step(model, MasterAdamW(model, lr=1e-3), prompts, comps, loss_masks=masks)
    assert m["sft/tokens"] == n == 18 + 5 + 16 + 3
    assert m["sft/loss"] == pytest.approx(expected, rel=1e-5)


class _TwoTurns(Environment):
    """Answers the first turn, ends the episode at the second with reward 1: only an evaluation that runs
    episodes through the environment can score anything."""

    def step(self, turn: Turn) -> StepResult:
        if turn.index == 0:
            return StepResult(observation=[65, 66, 67], tool_calls=1)
        return StepResult(done=True, reward=1.0)


class _ZeroRewards:
    """Single-turn rewards: every completion scores 0."""

    def __call__(self, completions, answers, examples):
        class R:
            rewards = [0.0] * len(completions)
            per_function = {"zero": rewards}
            correct = [False] * len(completions)  # the correctness verdict accuracy counts

        return R()


def test_held_out_evaluation_runs_the_episodes_through_the_environment():
    tok = byte_tokenizer()
    model = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0)
    engine = RolloutEngine(model, EngineConfig(num_kv_blocks=64), tokenizer=tok)
    examples = [Example(f"{i}*3=", str(3 * i)) for i in range(4)]
    settings = EpisodeSettings(max_turns=3, max_tokens_per_turn=4, max_episode_tokens=64, isolation="thread")
    env = EnvSetup(_TwoTurns, _TwoTurns, settings)
    kw = dict(max_tokens=4, samples=2, temperature=1.0)
    res = evaluate(engine, tok, PromptEncoder(tok, None), examples, _ZeroRewards(), env=env, **kw)
    assert res["eval/accuracy"] == 1.0 and res["eval/pass@2"] == 1.0
    assert res["eval/env/turns_mean"] == 2.0 and res["eval/env/tool_calls_mean"] == 1.0
    assert res["eval/env/observation_tokens_mean"] == 3.0 and res["eval/env/episodes"] == 8.0
    # Without the environment the same completions are single turns, scored by the rewards (0 here).
    res = evaluate(engine, tok, PromptEncoder(tok, None), examples, _ZeroRewards(), **kw)
    assert res["eval/accuracy"] == 0.0 and not any(k.startswith("eval/env/") for k in res)


def test_held_out_accuracy_with_several_samples_is_their_mean():
    """With k samples per problem the accuracy is the mean over all of them (pass@1 from k samples), not the
    first sample's: here every second sample is right, so it is 0.5 (the first samples alone: 0.0)."""

    class EverySecond:
        def __call__(self, completions, answers, examples):
            class R:
                rewards = [float(i % 2) for i in range(len(completions))]
                per_function = {"every_second": rewards}
                correct = [r > 0.5 for r in rewards]  # the correctness verdict accuracy counts

            return R()

    tok = byte_tokenizer()
    model = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0)
    engine = RolloutEngine(model, EngineConfig(num_kv_blocks=64), tokenizer=tok)
    examples = [Example(f"{i}*3=", str(3 * i)) for i in range(4)]
    res = evaluate(
        engine,
        tok,
        PromptEncoder(tok, None),
        examples,
        EverySecond(),
        max_tokens=4,
        samples=2,
        temperature=1.0,
    )
    assert res["eval/accuracy"] == 0.5 == res["eval/mean_accuracy"] and res["eval/pass@2"] == 1.0
