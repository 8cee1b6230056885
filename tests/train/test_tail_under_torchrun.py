"""Tail overlap (algorithm.overlap = "tail") runs on one process: under torchrun it is refused, by key, at every
door a multi-rank run comes through (issue 55, item 8), before anything launches or loads: `exactrl train --nproc N`
(colocated and disaggregated) and `exactrl plan --nproc N` before torchrun starts, and a rank of a torchrun launch
(`exactrl train` under RANK / WORLD_SIZE, world size 1 included) before its run loads. The same config on one
process is accepted (the negative control: the refusal is the launch's, not the config's)."""

from __future__ import annotations

from pathlib import Path

import pytest

import exactrl.distributed.launch as launch_module
from exactrl.cli import main
from exactrl.train import loop

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.toml")
TAIL = "algorithm.overlap=tail"
SAID = 'algorithm.overlap = "tail" runs on one process'
FP8 = "model.precision=fp8"  # fp8 runs on ranks: launched and planned (docs/fp8.md, "Several processes")


@pytest.fixture
def no_launch(monkeypatch):
    """Record every torchrun launch and every run started, instead of starting them."""
    started: list[str] = []
    monkeypatch.setattr(
        launch_module,
        "launch",
        lambda nodes, *a, **k: started.append(f"launch {nodes.nnodes * nodes.nproc_per_node}") or 0,
    )
    monkeypatch.setattr(loop, "train", lambda *a, **k: started.append("train") or {})
    return started


def _train(tmp_path: Path, *sets: str, nproc: int | None = None) -> list[str]:
    argv = ["train", QUICKSTART, "--set", f"run.output_dir={tmp_path / 'run'}", "--overwrite"]
    argv += [x for s in sets for x in ("--set", s)]
    return argv + (["--nproc", str(nproc)] if nproc is not None else [])


@pytest.mark.parametrize(
    ("nproc", "sets"), [(2, ()), (3, ("distributed.generator_ranks=1",))], ids=["colocated", "disaggregated"]
)
def test_train_nproc_refuses_tail_overlap_before_launching(tmp_path, capsys, no_launch, nproc, sets):
    assert main(_train(tmp_path, *sets, nproc=nproc)) == 0 and no_launch == [f"launch {nproc}"]  # control
    no_launch.clear()
    assert main(_train(tmp_path, *sets, TAIL, nproc=nproc)) == 2
    err = capsys.readouterr().err
    assert no_launch == [] and "algorithm.overlap" in err, err
    if not sets:
        assert SAID in err and "(not under torchrun)" in err
    assert main(_train(tmp_path, *sets, FP8, nproc=nproc)) == 0 and no_launch == [f"launch {nproc}"]


def test_a_torchrun_rank_refuses_tail_overlap_before_its_run_loads(tmp_path, capsys, monkeypatch, no_launch):
    """What a plain `torchrun ... -m exactrl.cli train` rank meets (world size 1 is still torchrun)."""
    assert main(_train(tmp_path, TAIL)) == 0 and no_launch == ["train"]  # one process: accepted
    no_launch.clear()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(_train(tmp_path, TAIL)) == 2
    err = capsys.readouterr().err
    assert no_launch == [] and SAID in err, err


def test_plan_nproc_refuses_tail_overlap(capsys):
    assert main(["plan", QUICKSTART, "--set", TAIL]) == 0  # one process: planned
    capsys.readouterr()
    assert main(["plan", QUICKSTART, "--set", TAIL, "--nproc", "2"]) == 2
    assert SAID in capsys.readouterr().err
    assert main(["plan", QUICKSTART, "--set", FP8, "--nproc", "2"]) == 0
