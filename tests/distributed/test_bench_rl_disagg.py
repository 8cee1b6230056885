"""`exactrl bench rl --nproc 2` on CPU ranks (gloo), colocated and with one generator rank (one step off), launched
as a user launches it: the record names the layout, times each role's stages, counts mismatches, and compares
with a baseline record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.extended,
]  # a benchmark harness; the layout's bits are test_disagg.py's

ROOT = Path(__file__).resolve().parents[2]
TINY = (
    "bench rl --preset tiny --device cpu --dtype float32 --prompts 2 --samples 2 --prompt-min 4 --prompt-max 8 "
    "--max-tokens 12 --completion-median 6 --steps 2 --max-num-seqs 8 --tokens-per-microbatch 64 --nproc 2"
).split()


def _bench(tmp: Path, *extra: str, printed: list[str] | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    argv = [sys.executable, "-m", "exactrl.cli", *TINY, "--out-dir", str(tmp), *extra]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    if printed is not None:
        printed += p.stdout.splitlines()
    return json.loads(p.stdout.strip().splitlines()[-1])  # the printed line: the record less its trace


def test_bench_rl_on_two_ranks_colocated_and_disaggregated(tmp_path: Path) -> None:
    co = _bench(tmp_path)
    assert (co["world_size"], co["generator_ranks"], co["mismatch_num_mismatched_tokens"]) == (2, 0, 0)
    assert co["weight_sync_full_gb_per_s"] > 0 and co["tokens_per_s_per_gpu"] > 0
    base = tmp_path / "rl-tiny-nproc2-exact-cpu.json"
    assert json.loads(base.read_text())["step_s_median"] == co["step_s_median"]
    table: list[str] = []
    dis = _bench(
        tmp_path,
        "--generator-ranks",
        "1",
        "--max-off-policy-steps",
        "1",
        "--baseline",
        str(base),
        printed=table,
    )
    # Only what applies: no partial rollouts here (no "partial:" row), and a trainer without an engine has no
    # engine figures (the generators' are theirs: no "engine_steps 0" of the trainer).
    table = [row for row in table if not row.startswith("{")]  # the rows, not the JSON line
    assert not any("partial:" in row for row in table) and "engine_steps" not in dis, table
    assert not any(row.split()[:1] == ["engine_steps"] for row in table), table
    assert any(
        row.split()[:3] == ["generators:", "engine_steps", str(dis["generator_engine_steps"])]
        for row in table
    )
    assert (dis["world_size"], dis["generator_ranks"], dis["trainer_ranks"]) == (2, 1, 1)
    assert (
        dis["mismatch_num_mismatched_tokens"] == 0 and dis["mismatch_num_tokens"] == dis["generated_tokens"]
    )
    assert dis["offpolicy_versions_behind"] == 1.0 and dis["device"] == "cpu"
    assert (dis["baseline_world_size"], dis["baseline_generator_ranks"]) == (2, 0)
    assert dis["speedup_vs_baseline"] == pytest.approx(co["step_s_median"] / dis["step_s_median"], rel=1e-12)
    # The trainer's stages add up to its step; the generator generated during the timed steps and received the
    # weights every step; the full model's send was timed.
    stages = ("train_s", "weight_sync_s", "weight_send_s", "offpolicy_wait_s", "idle_s")
    assert sum(dis[k] for k in stages) == pytest.approx(dis["step_s"], rel=1e-9)
    (gen,) = dis["generators"]
    assert gen["rank"] == 1 and gen["generate_s"] > 0 and gen["weight_recv_s"] > 0
    # The generator's engine: its steps in the timed rounds, its preemptions, its cache.
    assert gen["engine_steps"] > 0 and dis["generator_preemptions"] == gen["preemptions"] >= 0
    assert dis["generator_kv_cache_tokens"] == gen["kv_cache_tokens"] > 0
    assert dis["weight_send_full_gb_per_s"] > 0 and dis["weight_sync_full_bytes"] > 0
    assert (tmp_path / "rl-tiny-nproc2-gen1-offpolicy1-exact-cpu.json").is_file()


def test_bench_rl_with_the_engine_split_over_two_ranks(tmp_path: Path) -> None:
    # The engine split over the two ranks (expert parallel): the bench's engine is called by both together, as
    # the run's is (each rank alone, their forwards' collectives would pair different batches).
    rec = _bench(tmp_path, "--preset", "tiny-moe", "--set", "engine.expert_parallel=2")
    assert (rec["world_size"], rec["expert_parallel"], rec["mismatch_num_mismatched_tokens"]) == (2, 2, 0)
    assert rec["mismatch_num_tokens"] == rec["generated_tokens"] > 0 and rec["engine_steps"] > 0
