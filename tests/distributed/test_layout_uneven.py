"""Generator layouts with several engines and more trainers than engines (issue 55, item 8), without a launch: both
sides of the disaggregated layout agree on which trainers an engine serves (a trainer sends its commands to
`generators_of`, a generator serves `trainers_of`: exactrl/train/disagg.py), for every layout that
`trainer_ranks` accepts up to 12 ranks, uneven ones included (3 trainers on 2 engines: the first engine serves
two); and a generator's memory plan sizes its KV cache for the engine that serves the most trainers' prompts, the
prompts as the trainers really split them (`DistContext.shard`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from exactrl.distributed.env import DistContext
from exactrl.distributed.layout import Layout, trainer_ranks
from exactrl.train.memory_generator import plan_generator

sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
from test_plan import run_cfg  # noqa: E402  (the tiny bf16 config the plan tests share)


def _layouts(max_world: int = 12):
    """Every (world size, generator ranks, engine group size) that `trainer_ranks` accepts."""
    for w in range(2, max_world + 1):
        for g in range(1, w):
            for s in (1, 2, 3, 4):
                try:
                    trainer_ranks(w, g, s)
                except ValueError:
                    continue
                yield w, g, s


def test_both_sides_agree_on_which_trainers_an_engine_serves():
    uneven = 0
    for w, g, s in _layouts():
        lay = Layout(
            DistContext(rank=0, world_size=w, backend="gloo"),
            g,
            "trainer",
            DistContext.single(),
            group_size=s,
        )
        n, engines = w - g, g // s
        generators = range(n, w)
        uneven += n % engines != 0
        for t in range(n):
            ranks = lay.generators_of(t)
            # One engine: S consecutive generator ranks, the first of which answers.
            assert len(ranks) == s and ranks == list(range(ranks[0], ranks[0] + s)), (w, g, s, t)
            assert ranks[0] == lay.generator_of(t) and set(ranks) <= set(generators), (w, g, s, t)
            assert [lay.answers(r) for r in ranks] == [True] + [False] * (s - 1), (w, g, s, t)
            # The other side: every rank of that engine serves this trainer, and no other engine does.
            for r in generators:
                assert (t in lay.trainers_of(r)) == (r in ranks), (w, g, s, t, r)
        # Every engine serves someone, and the shares differ by one trainer at most (r % engines).
        served = [len(lay.trainers_of(n + j * s)) for j in range(engines)]
        assert sum(served) == n and min(served) >= 1 and max(served) - min(served) <= 1, (w, g, s, served)
    assert uneven >= 10  # the cases this test is for: trainers that do not divide evenly among the engines


@pytest.mark.parametrize(
    ("world", "sets"),
    [
        (5, ("distributed.generator_ranks=2",)),  # 3 trainers, 2 engines: the first serves trainers 0 and 2
        (7, ("distributed.generator_ranks=2",)),  # 5 trainers, 2 engines: 3 and 2
        (7, ("distributed.generator_ranks=2", "engine.tensor_parallel=2")),  # 5 trainers, 1 engine of 2 ranks
        (8, ("distributed.generator_ranks=3",)),  # 5 trainers, 3 engines: 2, 2 and 1
    ],
)
def test_a_generator_plan_holds_the_largest_engine_call(world: int, sets: tuple[str, ...]):
    """rollouts_per_step = 40 in groups of 4: 10 prompts, which no trainer count here divides either."""
    cfg = run_cfg("algorithm.rollouts_per_step=40", "algorithm.group_size=4", *sets)
    plan = plan_generator(cfg, world_size=world, device="cpu")
    g, s = cfg.distributed.generator_ranks, max(cfg.engine.tensor_parallel, cfg.engine.expert_parallel)
    n = world - g
    lay = Layout(
        DistContext(rank=0, world_size=world, backend="gloo"),
        g,
        "trainer",
        DistContext.single(),
        group_size=s,
    )
    share = [
        len(DistContext(rank=r, world_size=n, backend="gloo").shard(cfg.algorithm.prompts_per_step))
        for r in range(n)
    ]
    # An engine samples the prompts of every trainer it serves in one call (exactrl/train/disagg.py).
    calls = [sum(share[t] for t in lay.trainers_of(n + j * s)) for j in range(g // s)]
    most = max(len(lay.trainers_of(n + j * s)) for j in range(g // s))
    assert plan.counts["trainers_served"] == most
    a, e = cfg.algorithm, cfg.engine
    grow = min(cfg.sampling.max_tokens, e.max_model_len)
    need = max(calls) * (cfg.task.max_prompt_tokens + a.group_size * grow + e.block_size * a.group_size)
    assert plan.counts["rollout_tokens_needed"] >= need, (calls, plan.counts)
    assert plan.counts["kv_blocks"] * e.block_size >= need
