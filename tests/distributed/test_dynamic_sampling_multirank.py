"""Dynamic sampling under torchrun (2 CPU ranks, gloo): the decision is global, so the ranks train on the groups one
process keeps. Step 1 samples from the same weights at both world sizes (the sampling noise is keyed by the prompt's
place in the round, not by the rank), so its sampled groups, rewards and dynamic sampling counts are the one-process
run's; later steps follow weights that differ in their last bits (FSDP2's gradient reduction order), so only their
exactness is compared. The decision logic itself is tested over two threads in tests/train/test_dynamic_sampling.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._runs import launch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
]  # two ranks repeat the two-thread test above; make test-all runs it

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("_driver.py")

COIN = """
import hashlib

def coin(completion, answer, example):
    return float(int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 4 == 0)
"""

SETS = [
    "sft.steps=0",
    "train.warmup_steps=0",
    "train.lr_schedule=constant",
    "train.steps=2",
    "algorithm.rollouts_per_step=8",
    "algorithm.group_size=2",
    "algorithm.dynamic_sampling=reward",
    "task.num_eval=0",
    "task.eval_every=0",
    "sampling.max_tokens=4",
    "sampling.temperature=1.0",
    "run.progress=false",
    "run.tensorboard=false",
    "run.report=false",
]


def _argv(tmp: Path, name: str) -> list[str]:
    sets = [*SETS, f"run.output_dir={tmp / name}", f'reward.functions=["{tmp / "coin.py"}:coin"]']
    return [
        "train",
        str(ROOT / "configs" / "quickstart.toml"),
        *[x for s in sets for x in ("--set", s)],
        "--overwrite",
    ]


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "optimizer_steps" in r]


def test_two_ranks_keep_the_groups_of_one_process(tmp_path):
    from exactrl.cli import main

    (tmp_path / "coin.py").write_text(COIN)
    assert main(_argv(tmp_path, "one")) == 0
    code, out, _ = launch(
        DRIVER, tmp_path, 2, [{"kind": "cli", "argv": _argv(tmp_path, "two")}], "ds", timeout=600
    )
    assert code == 0, out[-4000:]
    one, two = _steps(tmp_path / "one"), _steps(tmp_path / "two")
    assert len(one) == len(two) == 2
    first = [k for k in one[0] if k.startswith(("dynamic_sampling/", "reward/", "response_length/"))]
    assert any(k == "dynamic_sampling/groups_dropped" for k in first)
    assert {k: one[0][k] for k in first} == {k: two[0][k] for k in first}
    assert one[0]["dynamic_sampling/extra_rounds"] > 0  # the step resampled, on both
    for r in two:
        assert r["mismatch/num_mismatched_tokens"] == 0 and r["mismatch/num_tokens"] > 0
        assert r["dynamic_sampling/groups_kept"] + r["dynamic_sampling/groups_missing"] == 4
