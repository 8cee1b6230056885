"""Episodes in lockstep (exactrl/envs/rollout.py, "Lockstep"), in one process: two members of a group, each a thread
with its own engine of the same weights, exchange their verdicts through a fake `gather` (a barrier standing in for
`TensorParallelGroup.gather_objects`). Rank 0's environments answer at once, rank 1's after a delay, so answers
arrive at different times on the two ranks. What a split engine needs: both engines run the very same steps (the same
sequences, positions and KV blocks in every forward, in the same order), and each rank's episodes are bit for bit
the ones an engine running its prompts alone gives. Control: without lockstep, the same two ranks' engines step
differently (the trace comparison can fail). The end-to-end runs over gloo ranks (a split engine, colocated and on
generator ranks) are tests/distributed/test_train_tensor_parallel.py's and test_disagg_split.py's (make test-all)."""

from __future__ import annotations

import functools
import pickle
import threading
import time
from typing import Any

import torch

from exactrl.engine import engine as engine_module
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.envs import Environment, EpisodeSettings, StepResult, run_episodes
from exactrl.envs.rollout import EpisodeBatch, Lockstep
from exactrl.model import build_model, preset
from exactrl.model.tokenizer import byte_tokenizer
from exactrl.tasks.base import Example


class Uneven(Environment):
    """Episodes of 1 to 3 turns with observations of 0 to 3 tokens, all decided by the tokens the model wrote (never
    by time); each answer comes after `delay_s`."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def reset(self, example):
        self.turns = 0

    def step(self, turn):
        time.sleep(self.delay_s)
        self.turns += 1
        s = sum(turn.token_ids)
        if s % 3 == 0:
            return StepResult(done=True, reward=(s % 7) / 6, tool_calls=1)
        return StepResult(observation=[65 + self.turns] * (s % 4), reward=0.1 * self.turns)


SETTINGS = EpisodeSettings(max_turns=3, max_tokens_per_turn=5, max_episode_tokens=64, isolation="thread")
PARAMS = SamplingParams(temperature=1.0, n=2, seed=5)
EXAMPLES = [Example(f"Q{i}:", str(i)) for i in range(4)]
TOK = byte_tokenizer()
PROMPTS = [TOK.encode(e.prompt) for e in EXAMPLES]
IDS = [100 + i for i in range(len(EXAMPLES))]
SHARES = [range(0, 2), range(2, 4)]  # rank r owns these prompts
# Rank r's environments answer after this long: several engine steps, even on a loaded machine.
DELAYS = [0.0, 0.1]
_MODEL: dict[str, Any] = {}


def _engine() -> RolloutEngine:
    if "m" not in _MODEL:
        _MODEL["m"] = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0)
    return RolloutEngine(_MODEL["m"], EngineConfig(num_kv_blocks=64), tokenizer=TOK)


def _traced(monkeypatch) -> dict[int, list]:
    """Every forward's batch (sequence, first position, tokens, KV blocks of each entry), per engine."""
    traces: dict[int, list] = {}
    launch = engine_module._Generation.launch

    def traced(self, batch, *a, **kw):
        step = [
            (e.seq.request_id, e.seq.sample_index, e.start, e.num_new_tokens, tuple(e.block_table))
            for e in batch.entries
        ]
        traces.setdefault(id(self.engine), []).append(step)
        return launch(self, batch, *a, **kw)

    monkeypatch.setattr(engine_module._Generation, "launch", traced)
    return traces


class _Group:
    """`size` members that exchange pickled objects (every member gets every member's, in rank order)."""

    def __init__(self, size: int) -> None:
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)

    def gather(self, rank: int, obj: Any) -> list[Any]:
        self.slots[rank] = pickle.dumps(obj)
        self.barrier.wait()
        out = [pickle.loads(b) for b in self.slots]
        self.barrier.wait()  # everyone has read before the next exchange writes
        return out


def _group_run(lockstep: bool) -> tuple[list[EpisodeBatch], list[RolloutEngine]]:
    """Both ranks run the union of the prompts, each calling its own prompts' environments in lockstep (or, without,
    every environment itself)."""
    group = _Group(2)
    engines = [_engine(), _engine()]
    got: list[Any] = [None, None]

    def member(r: int) -> None:
        lock = Lockstep(functools.partial(group.gather, r), [i in SHARES[r] for i in range(len(EXAMPLES))])
        make = functools.partial(Uneven, DELAYS[r])
        args = (engines[r], TOK, EXAMPLES, PROMPTS, make, SETTINGS, PARAMS)
        got[r] = run_episodes(*args, request_ids=IDS, lockstep=lock if lockstep else None)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(g is not None for g in got)
    return got, engines


def _flat(eb: EpisodeBatch) -> list[tuple]:
    return [
        (
            e.request_id,
            e.sample_index,
            e.token_ids,
            e.loss_mask,
            e.rollout_logprobs,
            e.reward,
            e.finish_reason,
        )
        for g in eb.groups
        for e in g
    ]


def _same(a: EpisodeBatch, b: EpisodeBatch) -> bool:
    fa, fb = _flat(a), _flat(b)
    untimed = [{k: v for k, v in x.metrics.items() if "time_s" not in k} for x in (a, b)]
    return (
        len(fa) == len(fb)
        and a.errors == b.errors
        and untimed[0] == untimed[1]
        and all(x[:4] == y[:4] and torch.equal(x[4], y[4]) and x[5:] == y[5:] for x, y in zip(fa, fb))
    )


def test_lockstep_ranks_step_alike_and_each_gets_its_own_episodes(monkeypatch):
    traces = _traced(monkeypatch)
    got, engines = _group_run(lockstep=True)
    steps = [traces[id(e)] for e in engines]
    assert steps[0] == steps[1] and len(steps[0]) > 10  # the same forwards, in the same order
    turns: set[int] = set()
    for r in (0, 1):
        share = list(SHARES[r])
        alone = run_episodes(
            _engine(),
            TOK,
            [EXAMPLES[i] for i in share],
            [PROMPTS[i] for i in share],
            functools.partial(Uneven, DELAYS[r]),
            SETTINGS,
            PARAMS,
            request_ids=[IDS[i] for i in share],
        )
        assert _same(got[r], alone), r
        turns |= {e.num_turns for g in alone.groups for e in g}
    assert len(turns) > 1  # episodes of different lengths: rounds in which some have ended
    # A group of one in lockstep is the run without it.
    lone = Lockstep(lambda obj: [obj], [True] * len(EXAMPLES))
    args = (TOK, EXAMPLES, PROMPTS, Uneven, SETTINGS, PARAMS)
    assert _same(
        run_episodes(_engine(), *args, request_ids=IDS, lockstep=lone),
        run_episodes(_engine(), *args, request_ids=IDS),
    )
    # Control: without lockstep the two ranks resume their episodes as their own answers arrive, and their engines
    # step differently (a split engine would hang or mix up rows).
    traces.clear()
    _, engines = _group_run(lockstep=False)
    assert traces[id(engines[0])] != traces[id(engines[1])]
