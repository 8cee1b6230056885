"""The disaggregated layout's set-up, without torchrun: what it refuses, and the weight buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exactrl.config import load_config
from exactrl.distributed.env import DistContext
from exactrl.distributed.layout import buckets, split_layout
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
        (DistContext(rank=0, world_size=3, backend="gloo"), 2, "more generators than trainers"),
    ],
)
def test_layouts_that_cannot_work_are_refused(world: DistContext, g: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        split_layout(world, g)


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
