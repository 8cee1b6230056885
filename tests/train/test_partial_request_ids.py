"""Partial rollouts' request ids across ranks (issue 55, item 8), without a launch. A request id keys a prompt's
sampling noise, so over the whole run (every rank's pool, every generation) no two prompts may share one, and a
prompt's id must not depend on which rank runs it: each rank's new groups carry the ids the one-process run gives
the same prompts (their place in the prompt stream every rank reads). The multi-rank tests compare two multi-rank
runs, which would both carry a bug here; this compares with the one-process numbering.

`PartialRollouts.sample` runs for real up to its engine call (`generate`, stubbed to record the new groups and stop):
the ranks' top-ups, uneven and changing between generations (a refused group makes its rank's larger), are what
`agree_top_ups` would have gathered."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from exactrl.distributed.env import DistContext
from exactrl.train.partial import PartialRollouts

# Each generation's top-ups, one per rank of 3 (sums 6, 4, 7): uneven, one rank empty once.
TOP_UPS = [[2, 1, 3], [1, 3, 0], [3, 2, 2]]


class _Stop(Exception):
    pass


def _new_groups(monkeypatch, world: int, top_ups: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Per generation, the (request id, stream index of its prompt) of every rank's new groups, in rank order."""
    made: list[tuple[int, int]] = []

    def generate(self, ctx, step, version, new):
        made.extend((g.request_id, g.example) for g in new)
        raise _Stop

    monkeypatch.setattr(PartialRollouts, "generate", generate)
    pools, streams = [], []
    for _ in range(world):
        pools.append(PartialRollouts(k=2, prompts_per_step=4, extra_groups=2, group_size=2))
        streams.append(itertools.count())  # every rank reads the same stream (its items: their index)
    out = []
    for step, tops in enumerate(top_ups):
        made.clear()
        for r, pool in enumerate(pools):

            def prompts(total, shard, s=streams[r]):
                assert shard is False
                ex = [next(s) for _ in range(total)]
                return ex, [[3, e] for e in ex], list(range(total))

            dist = DistContext(rank=r, world_size=world, backend="gloo" if world > 1 else None)
            ctx = SimpleNamespace(dist=dist, stages=SimpleNamespace(prompts=prompts))
            pool.top_ups = list(tops)
            with pytest.raises(_Stop):
                pool.sample(ctx, SimpleNamespace(version=step), step)
        out.append(list(made))
    return out


def test_partial_request_ids_are_unique_over_ranks_and_match_the_one_process_run(monkeypatch):
    ranks = _new_groups(monkeypatch, 3, TOP_UPS)
    one = _new_groups(monkeypatch, 1, [[sum(t)] for t in TOP_UPS])
    for step, (got, want) in enumerate(zip(ranks, one)):
        assert sorted(got) == sorted(want), step  # the prompts the one process ran, under its ids
    ids = [i for gen in ranks for i, _ in gen]
    assert len(ids) == sum(map(sum, TOP_UPS)) and len(set(ids)) == len(ids)
