"""A shared engine's uneven shares (issue 55, item 8), without a launch: `SharedEngine.generate` gathers the ranks'
shares, samples their union in one engine call and hands each rank its own outputs
(exactrl/distributed/shared_engine.py). The default suite's runs give every rank an equal share (or none); here the
ranks of a group of 3 ask for 1, 0 and 3 prompts. Each rank must get exactly what its own engine
would sample at group size 1 (the engine is batch-invariant): its request ids, tokens and logprobs, bit for bit.

The group is a stand-in (`gather_objects` returns the shares the test set, this rank's in its place); the engine is
the real one on the tiny model, its calls unsplit, which is what the ranks of a split engine compute together."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exactrl.distributed.shared_engine import SharedEngine, _Share
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model.loading import load_policy

PARAMS = SamplingParams(temperature=1.0, max_tokens=3, n=2, seed=11)


@pytest.fixture(scope="module")
def engine() -> RolloutEngine:
    model, _ = load_policy(preset_name="tiny", device="cpu", dtype="float32", exact=True, seed=0)
    return RolloutEngine(
        model, EngineConfig(block_size=16, max_model_len=64, num_kv_blocks=32, cuda_graphs=False)
    )


def _shares(sizes: list[int]) -> list[_Share]:
    """Rank r's prompts (distinct over the group) and request ids (the prompt's index in the step)."""
    out, i = [], 0
    for r, n in enumerate(sizes):
        prompts = [[3 + r, 5 + j, 7 + i + j, 2] for j in range(n)]
        out.append(_Share("generate", prompts, list(range(i, i + n)), PARAMS if n else None))
        i += n
    return out


def _outputs(outs) -> list[tuple[int, list[list[int]], list[torch.Tensor]]]:
    return [
        (o.request_id, [s.token_ids for s in o.samples], [s.rollout_logprobs for s in o.samples])
        for o in outs
    ]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and all(torch.equal(p, q) for p, q in zip(x[2], y[2]))
        for x, y in zip(a, b)
    )


def test_each_rank_of_a_shared_engine_gets_its_own_share_of_an_uneven_call(engine):
    sizes = [1, 0, 3]
    shares = _shares(sizes)
    alone = [
        _outputs(engine.generate(s.prompts, PARAMS, request_ids=s.request_ids)) if s.prompts else []
        for s in shares
    ]
    for r, mine in enumerate(shares):
        group = SimpleNamespace(
            rank=r,
            size=len(sizes),
            min=lambda x: x,
            gather_objects=lambda share, r=r: [share if q == r else s for q, s in enumerate(shares)],
        )
        got = _outputs(
            SharedEngine(engine, group).generate(
                mine.prompts, PARAMS if mine.prompts else None, mine.request_ids
            )
        )
        assert [o[0] for o in got] == mine.request_ids, (r, [o[0] for o in got])
        assert _same(got, alone[r]), r
    # Negative control: the ranks' outputs are not interchangeable (another rank's share is told apart).
    assert not _same(alone[0][: len(alone[2])], alone[2])
