"""The disaggregated layout's set-up, without torchrun: what it refuses, and the weight buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exactrl.config import load_config
from exactrl.distributed.env import DistContext
from exactrl.distributed.layout import Layout, buckets, split_layout
from exactrl.train.drivers.modes import choose_driver

ROOT = Path(__file__).resolve().parents[2]


def test_colocated_layout_is_the_job_itself() -> None:
    world = DistContext(rank=1, world_size=2, backend="gloo")
    layout = split_layout(world, 0)
    assert layout.role == "colocated" and layout.local is world and not layout.disaggregated


@pytest.mark.parametrize(
    ("world", "g", "words"),
    [
        (DistContext.single(), 1, "needs torchrun ranks"),
        (DistContext(rank=0, world_size=2, backend="gloo"), 2, "leaves no rank to train"),
        (
            DistContext(rank=0, world_size=3, backend="gloo"),
            2,
            "more generator engines \\(2\\) than trainers",
        ),
    ],
)
def test_layouts_that_cannot_work_are_refused(world: DistContext, g: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        split_layout(world, g)
    # Engines of several generator ranks: the group size must divide the generators (nothing is made before).
    with pytest.raises(ValueError, match="must divide the generator ranks"):
        split_layout(DistContext(rank=0, world_size=4, backend="gloo"), 3, 2)


def test_generator_engines_of_several_ranks_serve_whole_trainer_shares() -> None:
    # 2 trainers, 4 generators in 2 engines of 2: trainer r's engine is ranks 2 + 2 * (r % 2) and + 1; the first
    # answers; each engine's ranks serve the same trainers.
    lay = Layout(
        DistContext(rank=0, world_size=6, backend="gloo"), 4, "trainer", DistContext.single(), group_size=2
    )
    assert lay.engines == 2
    assert [lay.generators_of(r) for r in range(2)] == [[2, 3], [4, 5]]
    assert [lay.generator_of(r) for r in range(2)] == [2, 4]
    assert [lay.trainers_of(g) for g in range(2, 6)] == [[0], [0], [1], [1]]
    assert [lay.answers(g) for g in range(2, 6)] == [True, False, True, False]
    one = Layout(DistContext(rank=0, world_size=3, backend="gloo"), 1, "trainer", DistContext.single())
    assert one.generators_of(1) == [2] and one.trainers_of(2) == [0, 1] and one.answers(2)


@pytest.mark.parametrize(("key", "words"), [('algorithm.overlap="tail"', "algorithm.overlap")])
def test_modes_not_done_in_the_layout_are_refused_by_key(key: str, words: str) -> None:
    cfg = load_config(ROOT / "configs" / "quickstart.toml", ["distributed.generator_ranks=1", key])
    with pytest.raises(ValueError, match=words):
        choose_driver(cfg, distributed=False, moe=False)
    choose_driver(
        load_config(ROOT / "configs" / "quickstart.toml", [key]), distributed=False, moe=False
    )  # colocated, on one process: these modes run


def test_multi_turn_runs_in_the_layout() -> None:
    """Multi-turn episodes run on the generators ("episodes" commands, each against its own environment)."""
    cfg = load_config(
        ROOT / "configs" / "quickstart.toml", ["distributed.generator_ranks=1", 'env.name="calculator"']
    )
    assert choose_driver(cfg, distributed=True, moe=False) == "sync"


def test_buckets_keep_one_dtype_and_the_limit() -> None:
    ts = [
        torch.zeros(4),
        torch.zeros(4),
        torch.zeros(2, dtype=torch.bfloat16),
        torch.zeros(8),
        torch.zeros(1),
    ]
    # 16-byte limit: the two fp32 4-vectors fill one; the bf16 tensor starts another; the 32-byte tensor is alone.
    assert buckets(ts, limit=32) == [[0, 1], [2], [3], [4]]
    assert buckets(ts, limit=16) == [[0], [1], [2], [3], [4]]
    assert buckets([], limit=16) == []


def test_a_generator_sizes_its_kv_cache_by_its_own_fraction(monkeypatch) -> None:
    # A generator rank holds no trainer: its cache takes distributed.generator_kv_memory_fraction of what its
    # model leaves free, not engine.kv_memory_fraction (a colocated rank's, sized to share the card with training;
    # 0.2 held a lone generator's qwen3-1.7b cache to 250k tokens, 2 x H200, 2026-11-28).
    from types import SimpleNamespace

    import exactrl.model.loading as loading
    import exactrl.ops as ops
    from exactrl.config import ConfigError, apply_overrides, config_from_dict
    from exactrl.train.disagg import generator_engine

    cfg = apply_overrides(
        config_from_dict({"model": {"preset": "tiny"}}),
        ["engine.kv_memory_fraction=0.2", "distributed.generator_kv_memory_fraction=0.7"],
    )
    cfg.validate()
    monkeypatch.setattr(loading, "policy_structure", lambda **kw: (torch.nn.Linear(1, 1), None))
    monkeypatch.setattr(ops, "set_exact_environment", lambda exact: None)
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *a, **k: None)
    det = torch.utils.deterministic  # the flag it sets is put back after the test
    monkeypatch.setattr(det, "fill_uninitialized_memory", det.fill_uninitialized_memory)
    made = []
    generator_engine(cfg, SimpleNamespace(world=DistContext.single()), lambda m, c, tokenizer: made.append(c))
    assert made[0].kv_memory_fraction == 0.7
    assert made[0].max_num_seqs == cfg.engine.max_num_seqs  # the rest of [engine] as set
    bad = apply_overrides(cfg, ["distributed.generator_kv_memory_fraction=0"])
    with pytest.raises(ConfigError, match="distributed.generator_kv_memory_fraction"):
        bad.validate()


def test_a_generator_made_empty_refuses_to_generate_before_its_weights_arrive() -> None:
    """A generator's model is its structure given memory (`generator_engine`: every weight comes from trainer 0):
    asked to generate before a sync filled it, it stops with the parameter it lacks instead of sampling garbage."""
    from types import SimpleNamespace

    from exactrl.engine.engine import EngineConfig, RolloutEngine
    from exactrl.engine.sampler import SamplingParams
    from exactrl.model.loading import policy_structure
    from exactrl.train.disagg import Command, GeneratorLoop

    model, tok = policy_structure(preset_name="tiny", device="cpu")
    assert all(p.is_meta for p in model.parameters())
    model = model.to_empty(device="cpu").requires_grad_(False)
    ask = Command("generate", [[1, 2, 3]], SamplingParams(max_tokens=2), [0])
    layout = SimpleNamespace(
        world=SimpleNamespace(rank=1),
        trainers_of=lambda g: [0],
        answers=lambda g: True,
        recv=lambda src: ask,
        send=lambda obj, dst: None,
    )
    loop = GeneratorLoop(RolloutEngine(model, EngineConfig(num_kv_blocks=8), tokenizer=tok), layout)
    with pytest.raises(
        RuntimeError, match=r"generator rank 1: asked to generate before the weight sync filled"
    ):
        loop.serve()
