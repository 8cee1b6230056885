"""The engine's memory around its calls: a cache that grows is sized without the cache it replaces, a generator
holds its memory plan's cache, and the ranks of a shared engine that ask for different calls all refuse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset


def test_a_growing_cache_counts_the_old_one_and_a_capped_one_is_kept(monkeypatch) -> None:
    """A call that needs more blocks than the runner has is sized (`auto_num_blocks`) with the old cache's bytes
    counted as free (it is released before the larger one is allocated); a call whose size comes out no larger keeps
    the runner and its cache as they are: no release, no new allocation (which could move the cache and its graphs)."""
    import exactrl.engine.engine as engine_mod

    model = build_model(preset("tiny"), dtype=torch.float32, seed=0)
    eng = RolloutEngine(model, EngineConfig(block_size=16, max_num_seqs=8, max_model_len=128))
    extra: list[int] = []
    cap = [None]  # a memory budget in blocks (None: the real one)
    real = engine_mod.auto_num_blocks

    def measuring(*a, **k):
        extra.append(a[4] if len(a) > 4 else k.get("extra_free", 0))
        n = real(*a, **k)
        return n if cap[0] is None else min(n, cap[0])

    monkeypatch.setattr(engine_mod, "auto_num_blocks", measuring)
    params = SamplingParams(max_tokens=4, seed=0)
    eng.generate([[1, 2, 3]], params)  # the first cache: small
    small = eng.runner
    assert extra == [0] and small.num_blocks < 8
    big = [[1, 2, 3, 4, 5] * 20] * 6
    cap[0] = small.num_blocks  # the budget allows no more: kept, not allocated again
    eng.generate(big, params)
    assert eng.runner is small and small.kv_allocations == 1
    assert extra[-1] == small.kv_cache_bytes > 0  # the old cache counted as free
    cap[0] = None
    eng.generate(big, params)  # larger: a new runner
    assert eng.runner is not small and eng.runner.num_blocks > small.num_blocks


def test_a_generator_holds_its_memory_plans_cache(monkeypatch) -> None:
    """`run_generator` gives the engine its plan's KV blocks (as a colocated run's MemoryPhases does), so a larger
    call than the plan's (trainer 0's held-out evaluation) runs in that cache instead of growing it past the plan;
    engine.num_kv_blocks set by hand wins; without a plan (CPU) the engine sizes itself."""
    import exactrl.model.loading as loading
    import exactrl.ops as ops
    import exactrl.train.disagg as disagg
    import exactrl.train.memory_generator as memory_generator
    from exactrl.config import apply_overrides, config_from_dict
    from exactrl.distributed.env import DistContext

    cfg = config_from_dict({"model": {"preset": "tiny"}})
    monkeypatch.setattr(loading, "policy_structure", lambda **kw: (torch.nn.Linear(1, 1), None))
    monkeypatch.setattr(ops, "set_exact_environment", lambda exact: None)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *a, **k: None)
    det = torch.utils.deterministic  # the flag it sets is put back after the test
    monkeypatch.setattr(det, "fill_uninitialized_memory", det.fill_uninitialized_memory)
    made: list[EngineConfig] = []

    class Engine:
        def __init__(self, model, config, tokenizer=None) -> None:
            made.append(config)
            self.runner = None

    class Loop:
        def __init__(self, engine, layout, **kw) -> None:
            self.engine = engine

        def serve(self) -> None:
            pass

    monkeypatch.setattr(disagg, "GeneratorLoop", Loop)
    layout = SimpleNamespace(world=DistContext.single(), trainers=1)
    for plan, fixed, want in ((37, None, 37), (37, 20, 20), (None, None, None)):
        counts = None if plan is None else SimpleNamespace(counts={"kv_blocks": plan})
        monkeypatch.setattr(memory_generator, "check_generator_before_loading", lambda *a, c=counts, **k: c)
        run_cfg = cfg if fixed is None else apply_overrides(cfg, [f"engine.num_kv_blocks={fixed}"])
        disagg.run_generator(run_cfg, layout, make=Engine)
        assert made[-1].num_kv_blocks == want


class _Group:
    """A fake engine group of two ranks: gather_objects returns this rank's share beside a fixed other one."""

    def __init__(self, rank: int, other) -> None:
        self.rank, self.other = rank, other

    def gather_objects(self, share):
        return [share, self.other] if self.rank == 0 else [self.other, share]

    def min(self, n: int) -> int:
        return n


def test_shared_engine_ranks_asking_different_calls_all_refuse() -> None:
    """A rank asking for episodes with no prompt of its own (an empty share) beside one asking for a generation: both
    refuse, naming each rank's call, instead of one going into the other call's collectives (a hang on a GPU).
    A rank that only joins a round (no call named) goes with the others' call."""
    from exactrl.distributed.shared_engine import SharedEngine, _Share

    model = build_model(preset("tiny"), dtype=torch.float32, seed=0)
    params = SamplingParams(max_tokens=3, seed=0)
    eng = RolloutEngine(model, EngineConfig(block_size=16, max_num_seqs=4, max_model_len=64))
    empty_episodes = _Share("episodes", [], [], None)
    shared = SharedEngine(eng, _Group(0, empty_episodes))
    with pytest.raises(RuntimeError, match="group rank 0 'generate', group rank 1 'episodes'"):
        shared.generate([[1, 2, 3]], params)
    # The other side: this rank asks for episodes with nothing, the other for a generation.
    other = SharedEngine(eng, _Group(1, _Share("generate", [[1, 2, 3]], [0], params)))
    with pytest.raises(RuntimeError, match="different calls"):
        other._episodes(other._gather(_Share("episodes", [], [], None)), [])
    # A joining rank (kind None) beside a generation: no refusal, the group's one call.
    joined = SharedEngine(eng, _Group(0, _Share("generate", [[1, 2, 3]], [0], params)))
    with joined.round():
        pass
    assert eng.runner is not None  # the group's generation ran here
