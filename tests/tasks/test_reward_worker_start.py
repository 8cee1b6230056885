"""A reward worker named by spec starts without re-running the parent's main module (under `exactrl train` that
main is exactrl.cli: torch and the whole package, 2-3 s a worker); a function passed by value, which may live in
that main module, keeps the re-run it needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The parent's main script: it records every time it runs as a worker's re-run main (`__mp_main__`).
MAIN = """
import os
import pickle
import sys

if __name__ != "__main__":
    with open(os.environ["MAIN_RERUN_MARKER"], "a") as f:
        f.write(__name__ + "\\n")


def in_main(completion, answer, example):
    return 1.0


if __name__ == "__main__":
    from exactrl.tasks.reward_pool import WorkerPool

    if sys.argv[1] == "spec":
        ref = ("spec", "reward.py:scored", os.getcwd())
    else:
        ref = ("pickled", pickle.dumps(in_main), None)
    pool = WorkerPool([ref], 1)
    print(pool.start_one())
    pool.close()
"""


@pytest.mark.parametrize("kind", ["spec", "pickled"])
def test_a_worker_reruns_the_parents_main_only_when_its_function_may_live_there(tmp_path, kind):
    (tmp_path / "main.py").write_text(MAIN)
    (tmp_path / "reward.py").write_text("def scored(completion, answer, example):\n    return 1.0\n")
    marker = tmp_path / "reruns.txt"
    env = dict(os.environ, MAIN_RERUN_MARKER=str(marker), PYTHONPATH=str(ROOT))
    p = subprocess.run(
        [sys.executable, "main.py", kind], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "('ok'" in p.stdout, p.stdout  # the worker resolved its function either way
    reruns = marker.read_text().split() if marker.exists() else []
    # by spec: never re-run (the fix); by value: re-run, where the pickled `in_main` is found (the control)
    assert reruns == ([] if kind == "spec" else ["__mp_main__"])
