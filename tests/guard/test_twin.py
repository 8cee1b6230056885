"""`exactrl twin`: the quickstart config, shrunk to 2 RL steps of 16 rollouts, in exact, fast and fast + TIS mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exactrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "sft.steps=2",
    "sft.batch_size=8",
    "sft.warmup_steps=0",
    "train.warmup_steps=0",
    "train.lr_schedule=constant",
    "algorithm.rollouts_per_step=16",
    "algorithm.group_size=4",
    "task.num_eval=8",
    "task.eval_every=0",
    "sampling.max_tokens=4",
    "sampling.temperature=1.0",
    "run.progress=false",
    "run.tensorboard=false",
    "run.report=false",
]


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny runs: one thread is faster than two spinning on a shared machine
    out = tmp_path_factory.mktemp("twin") / "q-twin"
    args = ["twin", str(ROOT / "configs" / "quickstart.toml"), "--steps", "2", "--out", str(out)]
    for s in SMALL:
        args += ["--set", s]
    try:
        rc = main(args)
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    return out, args


def test_twin_writes_three_runs_and_one_report(twin):
    out, _ = twin
    for name in ("exact", "fast", "fast-tis"):
        assert (out / name / "metrics.jsonl").is_file() and (out / name / "summary.json").is_file(), name
    cfg = (out / "fast-tis" / "config.toml").read_text()
    assert 'rollout_correction = "token-tis"' in cfg and "exact = false" in cfg
    assert "exact = true" in (out / "exact" / "config.toml").read_text()
    png = (out / "twin.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    table = (out / "twin.md").read_text()
    assert table.count("\n| exact |") == 1 and "| fast |" in table and "| fast + token-tis |" in table
    s = json.loads((out / "twin.json").read_text())["runs"]
    assert all(s[k]["steps"] == 2 for k in s)
    # The point of the comparison: exact mode has no mismatched token, fast mode has some.
    assert s["exact"]["compared_tokens"] > 0 and s["exact"]["mismatched_tokens"] == 0
    assert s["exact"]["logprob_abs_diff_max_max"] == 0.0
    assert s["fast"]["mismatched_tokens"] > 0 and s["fast"]["logprob_abs_diff_max_max"] > 0
    assert f"{s['fast']['mismatched_tokens']} of {s['fast']['compared_tokens']}" in table


def test_twin_refuses_to_overwrite_its_runs(twin, capsys):
    _, args = twin
    assert main(args) == 2
    assert "is not empty" in capsys.readouterr().err


def test_twin_configs_with_mis_and_bad_names(tmp_path):
    from exactrl.guard.twin import twin_configs

    root, runs = twin_configs(
        ROOT / "configs" / "quickstart.toml",
        [],
        steps=5,
        out_dir=tmp_path / "t",
        tis="seq-tis",
        mis="token-mis",
    )
    got = {
        v.name: (c.run.exact, c.algorithm.rollout_correction, c.train.steps, c.run.output_dir)
        for v, c in runs
    }
    assert got == {
        "exact": (True, None, 5, str(tmp_path / "t" / "exact")),
        "fast": (False, None, 5, str(tmp_path / "t" / "fast")),
        "fast-tis": (False, "seq-tis", 5, str(tmp_path / "t" / "fast-tis")),
        "fast-mis": (False, "token-mis", 5, str(tmp_path / "t" / "fast-mis")),
    }
    sft = {v.name: (c.sft.steps, c.sft.checkpoint) for v, c in runs}
    shared = str(tmp_path / "t" / "exact" / "sft")
    assert sft == {
        "exact": (250, None),
        "fast": (0, shared),
        "fast-tis": (0, shared),
        "fast-mis": (0, shared),
    }
    default_root, _ = twin_configs(ROOT / "configs" / "quickstart.toml", [])
    assert default_root == Path("runs/quickstart-twin")
    with pytest.raises(ValueError, match="--mis must be one of"):
        twin_configs(ROOT / "configs" / "quickstart.toml", [], mis="token-tis")
