"""Multi-turn episodes in the disaggregated layout, in one process: a trainer's `RemoteEngine.run_episodes` sends
an "episodes" command to a `GeneratorLoop` (in a thread, over in-process queues standing in for the gloo messages),
which runs `exactrl.envs.run_episodes` on its engine against its own environment and sends the `EpisodeBatch`
back. The batch must be the one `run_episodes` gives on an engine of the same weights in this process (token ids,
the engine's logprobs bitwise, observations, rewards, metrics). The end-to-end run (1 generator + 2 trainers
against the colocated run at world size 2) is tests/distributed/test_disagg.py's `variants` (make test-all).
Control: a generator whose weights differ from the trainer's engine gives other episodes (the comparison can fail)."""

from __future__ import annotations

import copy
import pickle
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.envs import Environment, EpisodeSettings, StepResult, run_episodes
from exactrl.envs.rollout import EnvSetup
from exactrl.model import build_model, preset
from exactrl.model.tokenizer import byte_tokenizer
from exactrl.tasks.base import Example
from exactrl.train.disagg import Command, GeneratorLoop, RemoteEngine


class Steps(Environment):
    """Observations growing with the turn; the reward counts the turns and the example's answer."""

    def reset(self, example):
        self.turns = 0
        self.bonus = int(example.answer)

    def step(self, turn):
        self.turns += 1
        return StepResult(observation=[66] * self.turns, reward=0.1 * self.turns + self.bonus)


@dataclass
class _World:
    rank: int
    world_size: int = 3


class _Layout:
    """Ranks 0 and 1 train, rank 2 generates; the messages are pickled onto queues, one per direction (as
    `Layout.send` pickles them onto the gloo group)."""

    def __init__(self, rank: int, boxes: dict[tuple[int, int], queue.Queue]) -> None:
        self.world = _World(rank)
        self.local = _World(rank, 2)
        self.boxes = boxes

    def send(self, obj: Any, dst: int) -> None:
        self.boxes[(self.world.rank, dst)].put(pickle.dumps(obj))

    def recv(self, src: int) -> Any:
        return pickle.loads(self.boxes[(src, self.world.rank)].get(timeout=120))

    def generator_of(self, trainer_rank: int) -> int:
        return 2

    def generators_of(self, trainer_rank: int) -> list[int]:
        return [2]

    def trainers_of(self, generator_rank: int) -> list[int]:
        return [0, 1]

    def answers(self, generator_rank: int) -> bool:
        return True


def _engine(model) -> RolloutEngine:
    return RolloutEngine(model, EngineConfig(num_kv_blocks=64), tokenizer=byte_tokenizer())


SETTINGS = EpisodeSettings(max_turns=3, max_tokens_per_turn=5, max_episode_tokens=64, isolation="thread")


def _flat(eb) -> list[tuple]:
    return [
        (e.prompt_ids, e.completion_ids, e.rollout_logprobs, e.reward, e.finish_reason, e.observations)
        for g in eb.groups
        for e in g
    ]


def _untimed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if "time_s" not in k}  # the environment's wall time differs


def _same(a, b) -> bool:
    fa, fb = _flat(a), _flat(b)
    if len(fa) != len(fb) or a.errors != b.errors or _untimed(a.metrics) != _untimed(b.metrics):
        return False
    for x, y in zip(fa, fb):
        if x[0] != y[0] or x[1] != y[1] or x[3:] != y[3:]:
            return False
        if not torch.equal(torch.as_tensor(x[2]), torch.as_tensor(y[2])):
            return False
    return True


def _served(generator_model) -> tuple[list, list]:
    """Trainers 0 and 1 each ask for their prompts' episodes (with their own request ids); the generator answers
    both in one round, one trainer after the other. Returns (what each trainer got, the examples / prompts / ids
    each asked with)."""
    boxes = {(a, b): queue.Queue() for a in range(3) for b in range(3) if a != b}
    loop = GeneratorLoop(_engine(generator_model), _Layout(2, boxes), env=EnvSetup(Steps, Steps, SETTINGS))
    loop.unfilled.clear()  # its weights are given here, not sent by a trainer's sync
    server = threading.Thread(target=loop.serve, daemon=True)
    server.start()
    tok = byte_tokenizer()
    params = SamplingParams(temperature=1.0, n=2, seed=3)
    asks = []
    for r in (0, 1):
        examples = [Example(f"Q{r}{i}:", str(i)) for i in range(2)]
        asks.append((examples, [tok.encode(e.prompt) for e in examples], [10 * r + i for i in range(2)]))
    got: list[Any] = [None, None]

    def trainer(r: int) -> None:
        remote = RemoteEngine(_Layout(r, boxes), EngineConfig())
        got[r] = remote.run_episodes(asks[r][0], asks[r][1], params, asks[r][2])

    threads = [threading.Thread(target=trainer, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in (0, 1):
        boxes[(r, 2)].put(pickle.dumps(Command("stop")))
    server.join(timeout=120)
    return got, asks


def test_episodes_on_the_generator_are_the_colocated_engines():
    model = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0)
    got, asks = _served(copy.deepcopy(model))
    params = SamplingParams(temperature=1.0, n=2, seed=3)
    for r in (0, 1):
        examples, prompts, ids = asks[r]
        here = run_episodes(
            _engine(model), byte_tokenizer(), examples, prompts, Steps, SETTINGS, params, request_ids=ids
        )
        assert got[r] is not None and _same(got[r], here), r
        assert max(e.num_turns for g in here.groups for e in g) > 1  # multi-turn, observations included
    # Control: a generator holding other weights samples other episodes.
    other = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=1)
    stale, _ = _served(other)
    assert not _same(stale[0], got[0])
