"""Run directories are never damaged: refusals, --overwrite, --resume's config diff, the run clock."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from exactrl.config import RunConfig, apply_overrides, save_config
from exactrl.train.rundir import RUN_FILES, RunClock, RunDirError, check_run_dir, config_changes


def cfg_in(out_dir: Path, *overrides: str) -> RunConfig:
    cfg = apply_overrides(RunConfig(), ["model.preset=tiny", f"run.output_dir={out_dir}", *overrides])
    cfg.validate()
    return cfg


def old_run(out_dir: Path, *overrides: str) -> RunConfig:
    """A directory as a finished run leaves it."""
    cfg = cfg_in(out_dir, *overrides)
    save_config(cfg, out_dir / "config.toml")
    (out_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (out_dir / "summary.json").write_text("{}\n")
    (out_dir / "report.png").write_bytes(b"png")
    (out_dir / "checkpoints" / "step-000001").mkdir(parents=True)
    (out_dir / "tensorboard").mkdir()
    (out_dir / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    return cfg


def test_fresh_dirs_are_fine(tmp_path):
    assert check_run_dir(cfg_in(tmp_path / "new")).to_delete == []
    (tmp_path / "empty").mkdir()
    assert check_run_dir(cfg_in(tmp_path / "empty")).to_delete == []


def test_non_empty_dir_is_refused_naming_it_and_the_ways_on(tmp_path):
    old_run(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(RunDirError) as e:
        check_run_dir(cfg_in(tmp_path))
    msg = str(e.value)
    assert str(tmp_path) in msg and "--resume" in msg and "--overwrite" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing touched


def test_a_dir_with_only_a_config_is_a_run_that_never_started(tmp_path):
    save_config(cfg_in(tmp_path), tmp_path / "config.toml")
    plan = check_run_dir(cfg_in(tmp_path))
    plan.commit(cfg_in(tmp_path))
    assert (tmp_path / "config.toml").is_file()


def test_overwrite_deletes_the_old_runs_files_only_at_commit(tmp_path):
    old_run(tmp_path)
    (tmp_path / "my_notes.txt").write_text("mine")  # not a run file: never deleted
    cfg = cfg_in(tmp_path, "train.lr=0.001")
    plan = check_run_dir(cfg, overwrite=True)
    assert (tmp_path / "metrics.jsonl").exists()  # checking writes nothing
    assert any("--overwrite" in n for n in plan.notes)
    plan.commit(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml", "my_notes.txt"]
    assert "lr = 0.001" in (tmp_path / "config.toml").read_text()
    assert {p.name for p in plan.to_delete} <= set(RUN_FILES)


def test_resume_and_overwrite_exclude_each_other(tmp_path):
    with pytest.raises(RunDirError, match="exclude"):
        check_run_dir(cfg_in(tmp_path), resume=True, overwrite=True)


@pytest.mark.parametrize(
    "change, shown",
    [
        ("algorithm.name=rloo", 'algorithm.name: "grpo" -> "rloo"'),
        ("train.lr=0.01", "train.lr: 1e-05 -> 0.01"),
        ("task.arithmetic_max_operand=9", "task.arithmetic_max_operand: 20 -> 9"),
        ("model.dtype=bfloat16", 'model.dtype: "float32" -> "bfloat16"'),
        ("run.seed=3", "run.seed: 0 -> 3"),
        ('reward.functions=["format_tags"]', 'reward.functions: ["numeric_match"] -> ["format_tags"]'),
        ("sampling.temperature=0.5", "sampling.temperature: 1.0 -> 0.5"),
    ],
)
def test_resume_refuses_changes_of_meaning_and_lists_them(tmp_path, change, shown):
    old_run(tmp_path)
    cfg = cfg_in(tmp_path, change, "train.steps=500")
    with pytest.raises(RunDirError) as e:
        check_run_dir(cfg, resume=True)
    msg = str(e.value)
    assert shown in msg and "--allow-config-change" in msg
    assert "train.steps" not in msg  # harmless: not listed among the refused
    plan = check_run_dir(cfg, resume=True, allow_config_change=True)
    assert any(shown in n and "allowed" in n for n in plan.notes)


def test_resume_accepts_harmless_changes(tmp_path):
    old_run(tmp_path)
    harmless = [
        "train.steps=500",
        "run.log_every=10",
        "run.progress=false",
        "run.tensorboard=false",
        "run.report=false",
        "engine.num_kv_blocks=64",
        "engine.max_num_seqs=8",
        "train.save_every=5",
        f"run.output_dir={tmp_path}",
    ]
    plan = check_run_dir(cfg_in(tmp_path, *harmless), resume=True)
    keys = {c.key for c in plan.changes}
    assert keys == {"train.steps", "run.log_every", "run.progress", "run.tensorboard", "run.report"} | {
        "engine.num_kv_blocks",
        "engine.max_num_seqs",
        "train.save_every",
    }
    assert all(c.harmless for c in plan.changes)


def test_resume_notes_that_a_decaying_schedule_follows_the_new_steps(tmp_path):
    old_run(tmp_path, "train.lr_schedule=cosine")
    plan = check_run_dir(cfg_in(tmp_path, "train.lr_schedule=cosine", "train.steps=500"), resume=True)
    assert any("decays to 0 at train.steps" in n for n in plan.notes)


def test_config_changes_lists_every_differing_key():
    a = RunConfig()
    b = apply_overrides(a, ["train.lr=0.5", "task.name=jsonl", "task.path=x.jsonl"])
    assert [str(c) for c in config_changes(a, b)] == [
        'task.name: "arithmetic" -> "jsonl"',
        'task.path: none -> "x.jsonl"',
        "train.lr: 1e-05 -> 0.5",
    ]
    assert config_changes(a, a) == []


def test_an_unreadable_saved_config_is_named(tmp_path):
    old_run(tmp_path)
    (tmp_path / "config.toml").write_text("[run\n")
    with pytest.raises(RunDirError, match="config.toml"):
        check_run_dir(cfg_in(tmp_path), resume=True)


def test_run_clock_carries_the_time_of_earlier_invocations():
    first = RunClock()
    summary: dict = {}
    time.sleep(0.02)
    first.stamp(summary)
    assert summary["elapsed_s"] >= 0.02
    second = RunClock()
    second.resume_from({"elapsed_s": 100.0})
    assert 100.0 <= second.total_s() < 101.0
