"""`exactrl plan`'s words for a disaggregated run: what to pass when --nproc is missing, counts in the singular,
and a trainer rank's table without the engine's rows (its generators hold the engine)."""

from __future__ import annotations

from pathlib import Path

from exactrl.cli import main

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml")


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", QUICKSTART, *args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_generator_ranks_without_nproc_ask_for_nproc_on_plan(capsys):
    for key in ("distributed.generator_ranks=1", "engine.tensor_parallel=2"):
        rc, out, err = _plan(capsys, "--set", key)
        assert rc == 2 and out == ""
        assert "pass --nproc N to `exactrl plan`" in err and "exactrl train --nproc N`)" not in err, err


def test_one_trainer_of_two_reads_in_the_singular_and_holds_no_engine_rows(capsys):
    rc, out, _ = _plan(capsys, "--nproc", "2", "--set", "distributed.generator_ranks=1", "--gpu-memory", "80")
    assert rc == 0, out
    assert out.startswith(
        "planned for the 1 trainer rank of 2 and, below it, the 1 generator rank (distributed.generator_ranks = 1) "
        "that holds the engine alone\n"
    ), out
    trainer, generator = out.split("generator rank 1 of 2")
    rows = lambda text: {line.split()[0] for line in text.splitlines() if line.strip()}  # noqa: E731
    assert "policy_shards" in rows(trainer)
    assert not {"engine_working_set", "kv_cache"} & rows(trainer), trainer
    assert {"engine_working_set", "kv_cache"} <= rows(generator), generator
    assert not any(line.startswith("{") for line in out.splitlines())  # no JSON line without --json
