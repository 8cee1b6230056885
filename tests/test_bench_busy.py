"""`exactrl bench ... --busy-cores N`: the figure a user on a shared host gets (issue 55, item 1: a busy core had
halved `bench train` before every CUDA command capped its host threads). The spinners run beside the timed steps
and the record says how many there were."""

from __future__ import annotations

import json

from exactrl import bench_records
from exactrl.cli import main


def test_bench_train_spins_the_cores_it_is_asked_for_and_records_them(tmp_path, capsys, monkeypatch):
    started = []

    def spy(n):
        procs = real(n)
        started.append([p.is_alive() for p in procs])
        return procs

    real = bench_records.busy_cores
    monkeypatch.setattr(bench_records, "busy_cores", spy)
    argv = ["bench", "train", "--preset", "tiny", "--device", "cpu", "--tokens-per-microbatch", "256"]
    argv += ["--steps", "1", "--json", "--out-dir", str(tmp_path)]
    try:
        assert main([*argv, "--busy-cores", "1"]) == 0
        rec = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1])
        assert started == [[True]] and rec["busy_cores"] == 1
        assert main(argv) == 0  # the control: none asked, none started, the record says 0
        rec = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1])
        assert started == [[True]] and rec["busy_cores"] == 0
    finally:
        import multiprocessing as mp

        for p in mp.active_children():  # the spinners are daemons of this test process: stop them here
            p.kill()
