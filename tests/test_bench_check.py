"""benchmarks/bench_check.py: a new result against the best recorded one of the same benchmark and shape."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_check", Path(__file__).resolve().parent.parent / "benchmarks" / "bench_check.py"
)
bench_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_check)


def _train(tps: float, **kw) -> dict:
    rec = {"bench": "train", "preset": "qwen3-0.6b", "mode": "exact", "dtype": "bfloat16", "gpu": "H100"}
    rec.update(tokens_per_step=8192, seq_len=1024, cuda_graphs=True, tokens_per_s=tps, commit="abc", date="d")
    rec.update(kw)
    return rec


def _write(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_ratio_against_the_best_comparable_record(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    _write(results / "old.jsonl", _train(70_000.0), _train(80_000.0), _train(99_000.0, seq_len=2048))
    _write(results / "other.json", _train(200_000.0, gpu="H200"))  # another GPU: never the reference
    new = _write(tmp_path / "new.json", _train(76_000.0))
    assert bench_check.main([str(new), "--results", str(results)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = out["bench_check"]
    assert row["best"] == 80_000.0 and row["candidates"] == 2
    assert row["ratio"] == pytest.approx(0.95)
    # Below the threshold: exit 1 and the verdict says so.
    assert bench_check.main([str(new), "--results", str(results), "--min-ratio", "0.96"]) == 1
    assert "slower" in capsys.readouterr().out


def test_times_compare_lower_is_better_and_unseen_shapes_are_new(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    rl = {"bench": "rl", "preset": "qwen3-1.7b", "mode": "exact", "dtype": "bfloat16", "gpu": "H100"}
    rl.update(prompts=64, samples=8, max_tokens=2048, completion_median=384.0)
    _write(results / "rl.json", {**rl, "step_s": 28.0}, {**rl, "step_s": 35.0})
    new = _write(tmp_path / "new.jsonl", {**rl, "step_s": 40.0}, {**rl, "samples": 4, "step_s": 1.0})
    assert bench_check.main([str(new), "--results", str(results)]) == 1  # 28 / 40 = 0.7 < 0.9
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bench_check"]
    assert rows[0]["best"] == 28.0 and rows[0]["ratio"] == pytest.approx(0.7)
    assert rows[1]["verdict"] == "new" and rows[1]["ratio"] is None


def test_records_written_before_a_key_existed_compare_with_its_default(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    old = _train(70_000.0)  # no world_size key: a single-device record
    _write(results / "old.json", old)
    new = _write(tmp_path / "new.json", _train(70_000.0, world_size=1), _train(70_000.0, world_size=2))
    assert bench_check.main([str(new), "--results", str(results)]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bench_check"]
    assert rows[0]["ratio"] == pytest.approx(1.0) and rows[1]["verdict"] == "new"


def test_every_bench_record_carries_its_commit_and_date():
    from types import SimpleNamespace

    from exactrl.bench import record_head

    head = record_head("train", SimpleNamespace(preset="tiny", mode="exact", dtype="float32"), "cpu")
    assert head["commit"] and len(head["commit"].split("+")[0]) == 12  # this test runs in a git checkout
    assert head["date"].count("-") == 2
