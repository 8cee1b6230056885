"""Fixtures of the multi-rank tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from exactrl.distributed.env import DistContext


@pytest.fixture
def one_gloo_rank():
    """A gloo process group of one rank in this process (FSDP2 at world size 1, no torchrun)."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistContext(rank=0, world_size=1, backend="gloo")
    dist.destroy_process_group()
