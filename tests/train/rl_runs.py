"""What the single-process RL-run tests (off-policy, partial rollouts, tail overlap) share: a config dict with
`section__key` overrides, a run's step records, those records without timing figures, and a checkpoint's weights.
(The multi-rank tests have theirs in tests/distributed/_runs.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from exactrl.config import RunConfig, config_from_dict


def run_config(d: dict[str, dict[str, Any]], over: dict[str, Any], output_dir: Path) -> RunConfig:
    """`d` with each `section__key` of `over` set, writing to `output_dir`."""
    for key, value in over.items():
        section, name = key.split("__")
        d.setdefault(section, {})[name] = value
    d["run"]["output_dir"] = str(output_dir)
    return config_from_dict(d)


def steps(run_dir: Path) -> list[dict]:
    """The run's RL step records (those that report optimizer steps)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "optimizer_steps" in r]


def untimed(rows: list[dict], prefixes: tuple[str, ...] = ("perf/",), any_time: bool = True) -> list[dict]:
    """The records without wall-clock figures (which differ between any two runs): keys starting with one of
    `prefixes` or ending in `_s`, and with `any_time` every key that mentions time."""
    return [
        {
            k: v
            for k, v in r.items()
            if not (k.startswith(prefixes) or k.endswith("_s") or (any_time and "time" in k))
        }
        for r in rows
    ]


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The policy weights of the run's checkpoint of `step`."""
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "policy" / "model.safetensors"))
