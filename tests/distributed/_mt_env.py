"""tests/envs/sample_envs.py's VaryingReward (two model turns around an observation, a reward that varies within a
group), importable by the torchrun ranks of tests/distributed (whose folder is on their sys.path) as
`env.name = "_mt_env:VaryingReward"`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "envs"))
from sample_envs import VaryingReward  # noqa: E402

__all__ = ["VaryingReward"]
