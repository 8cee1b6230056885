"""`exactrl bench train --fsdp --nproc 2` and `exactrl bench rollout --nproc 2` on CPU ranks (gloo), launched the
way a user launches them (the command re-launches itself under torchrun), at a tiny scale: the JSON holds every
rank's figures and the aggregate ones, and the scaling efficiency against a world-size-1 baseline."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from exactrl.bench import read_baseline
from exactrl.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # benchmark harness on two ranks: make test-all

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32"]
ROLLOUT = ["bench", "rollout", *TINY, "--concurrency", "5", "--prompt-len", "8", "--max-tokens", "6"]
TRAIN = ["bench", "train", "--fsdp", *TINY, "--tokens-per-microbatch", "64", "--steps", "3"]


def _exactrl(tmp: Path, argv: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    p = subprocess.run(
        [sys.executable, "-m", "exactrl.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


def _baseline(path: Path, bench: str, tokens_per_s: float, **keys) -> Path:
    """A world-size-1 record of the benchmark (its figure made up: the test checks the arithmetic)."""
    rec = {"bench": bench, "world_size": 1, "aggregate_tokens_per_s": tokens_per_s, **keys}
    path.write_text(json.dumps(rec) + "\n")
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bench")
    common = {"preset": "tiny", "mode": "exact", "dtype": "float32"}
    roll = _baseline(
        tmp / "rollout-ws1.json", "rollout", 100.0, concurrency=5, prompt_len=8, max_tokens=6, **common
    )
    train = _baseline(tmp / "train-ws1.json", "train-fsdp", 50.0, tokens_per_rank=64, **common)
    out = ["--out-dir", str(tmp / "out"), "--nproc", "2"]
    _exactrl(tmp, [*ROLLOUT, *out, "--baseline", str(roll)])
    _exactrl(tmp, [*TRAIN, *out, "--baseline", str(train)])
    return tmp / "out"


def test_rollout_on_two_ranks_splits_the_requests_and_reports_every_rank(results):
    rec = json.loads((results / "rollout-tiny-c5-ws2-exact-cpu.json").read_text())
    ranks = rec["per_rank"]
    assert rec["world_size"] == 2 and [r["rank"] for r in ranks] == [0, 1]
    # The 5 requests split 3 + 2, each rank's engine sampling its own share: 6 tokens each (no stop token).
    assert rec["concurrency"] == 5 and rec["concurrency_per_rank"] == [3, 2]
    assert [r["output_tokens"] for r in ranks] == [18, 12] and rec["output_tokens"] == 30
    wall = max(r["seconds"] for r in ranks)
    assert rec["seconds"] == wall and rec["aggregate_tokens_per_s"] == 30 / wall == rec["tokens_per_s"]
    assert rec["tokens_per_s_per_rank"] == [r["output_tokens"] / r["seconds"] for r in ranks]
    assert len(rec["peak_memory_gb"]) == 2 and all(m > 0 for m in rec["peak_memory_gb"])
    assert rec["peak_memory_kind"] == "host_max_rss"
    assert all(r["decode_s"] > 0 for r in ranks)
    assert rec["scaling_efficiency"] == rec["aggregate_tokens_per_s"] / 2 / 100.0
    assert rec["speedup_vs_baseline"] == rec["aggregate_tokens_per_s"] / 100.0


def test_train_fsdp_on_two_ranks_reports_every_rank_and_the_aggregate(results):
    rec = json.loads((results / "train-tiny-fsdp-ws2-exact-cpu.json").read_text())
    ranks = rec["per_rank"]
    assert rec["world_size"] == 2 and [r["rank"] for r in ranks] == [0, 1]
    assert rec["tokens_per_rank"] == 64 and rec["global_tokens_per_step"] == 128
    # A step lasts as long as its slowest rank; the figure is the median over the timed steps.
    assert all(len(r["step_s"]) == 3 for r in ranks)
    assert rec["step_s"] == [max(r["step_s"][i] for r in ranks) for i in range(3)]
    assert rec["step_s_median"] == statistics.median(rec["step_s"])
    assert rec["aggregate_tokens_per_s"] == 128 / rec["step_s_median"]
    assert rec["tokens_per_s_per_rank"] == [64 / statistics.median(r["step_s"]) for r in ranks]
    assert len(rec["mfu_per_gpu"]) == 2 and all(0 < m < 1 for m in rec["mfu_per_gpu"])
    assert len(rec["peak_memory_gb"]) == 2 and all(m > 0 for m in rec["peak_memory_gb"])
    assert rec["weight_sync_bytes"] > 0 and rec["weight_sync_s"] > 0
    assert rec["scaling_efficiency"] == rec["aggregate_tokens_per_s"] / 2 / 50.0
    assert "today_step_s" not in rec  # today's single-device path is measured at world size 1 only


def test_a_baseline_of_another_benchmark_or_shape_is_refused(tmp_path):
    keys = {"preset": "tiny", "mode": "exact", "dtype": "float32", "concurrency": 5}
    ok = _baseline(tmp_path / "a.json", "rollout", 10.0, **keys)
    assert read_baseline(str(ok), "rollout", keys)["aggregate_tokens_per_s"] == 10.0
    with pytest.raises(ValueError, match="concurrency = 5, this run has 8"):
        read_baseline(str(ok), "rollout", {**keys, "concurrency": 8})
    with pytest.raises(ValueError, match="a 'rollout' record; this benchmark compares with 'train-fsdp'"):
        read_baseline(str(ok), "train-fsdp", keys)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"bench": "rollout", "tokens_per_s": 3.0}))
    with pytest.raises(ValueError, match="no 'world_size'"):
        read_baseline(str(old), "rollout", {})
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_baseline(str(tmp_path / "missing.json"), "rollout", {})


def test_options_a_benchmark_does_not_implement_are_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["bench", "train", *TINY, "--tokens-per-microbatch", "16", "--steps", "1"]) == 2
    assert "add --fsdp" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["bench", "train", *TINY, "--baseline", "ws1.json"]) == 2
    assert "--baseline compares world sizes of the FSDP2 step: add --fsdp" in capsys.readouterr().err
    assert main(["bench", "rl", *TINY, "--fsdp"]) == 2
    assert "bench rl does not implement --fsdp" in capsys.readouterr().err
