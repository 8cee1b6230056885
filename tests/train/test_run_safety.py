"""Runs are never damaged, end to end through `exactrl train` / `exactrl sft`: nothing written before validation,
Ctrl-C in SFT saves and exits 130, the summary's time covers the whole run, samples.jsonl, quiet logs off a TTY.

The tests marked `needs_loop` exercise the calls loop.train makes into exactrl.train.rundir / logging / sft; they
run once loop.train takes the run-dir plan (`train(..., run_dir=plan)`)."""

from __future__ import annotations

import inspect
import json
import os
import signal
from pathlib import Path

import pytest
import torch

import exactrl.train.sft as sft_mod
from exactrl.cli import main
from exactrl.config import RunConfig, apply_overrides
from exactrl.model.loading import load_policy
from exactrl.train.loop import build_task, make_encoder, train
from exactrl.train.sft import run_sft

needs_loop = pytest.mark.skipif(
    "run_dir" not in inspect.signature(train).parameters,
    reason="loop.train does not yet call exactrl.train.rundir (integration step of the runs branch)",
)

SMALL = """
[run]
device = "cpu"
progress = true
tensorboard = false
report = false

[model]
preset = "tiny"

[engine]
max_model_len = 64

[sampling]
max_tokens = 3

[task]
name = "arithmetic"
use_chat_template = false
num_eval = 4
max_prompt_tokens = 16

[algorithm]
group_size = 4
rollouts_per_step = 8

[train]
steps = 2
lr = 3e-4

[sft]
steps = 3
lr = 3e-3
batch_size = 8
"""


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def config(tmp_path) -> Path:
    p = tmp_path / "small.toml"
    p.write_text(SMALL)
    return p


def test_run_sft_stops_after_the_step_it_was_in():
    cfg = apply_overrides(
        RunConfig(), ["model.preset=tiny", "sft.steps=5", "sft.batch_size=4", "run.progress=false"]
    )
    model, tok = load_policy(preset_name="tiny", device="cpu")
    asked = []
    logged = []

    def should_stop() -> bool:
        asked.append(1)
        return len(asked) >= 2

    res = run_sft(
        cfg, model, tok, make_encoder(cfg, tok), build_task(cfg), logged.append, should_stop=should_stop
    )
    assert res.stopped and res.steps_done == 2
    assert logged[-1]["sft_step"] == 1  # the last step done is logged
    res = run_sft(cfg, model, tok, make_encoder(cfg, tok), build_task(cfg), logged.append)
    assert not res.stopped and res.steps_done == 5


@needs_loop
def test_a_start_that_fails_validation_writes_nothing(config, tmp_path, capsys):
    run = tmp_path / "run"
    bad = ["--set", "task.name=jsonl", "--set", f"task.path={tmp_path / 'missing.jsonl'}"]
    assert main(["train", str(config), "--set", f"run.output_dir={run}", *bad]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert not run.exists() or not any(run.iterdir())


@needs_loop
def test_ctrl_c_in_sft_saves_and_exits_130(config, tmp_path, monkeypatch, capsys):
    real = sft_mod.sft_step
    calls = []

    def step_then_interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while SFT step 2 runs
        return real(*args, **kwargs)

    monkeypatch.setattr(sft_mod, "sft_step", step_then_interrupt)
    run = tmp_path / "run"
    assert main(["sft", str(config), "--set", f"run.output_dir={run}"]) == 130
    assert len(calls) == 2  # stopped after the step it was in
    assert (run / "sft" / "model.safetensors").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_early"] is True and summary["sft_steps_done"] == 2 and summary["rl_steps"] == 0
    out = capsys.readouterr().out
    assert "stopped during SFT" in out
    # A stopped SFT is not "done", and the outputs listed are the ones there (no checkpoints/ yet).
    assert "SFT done" not in out
    assert not (run / "checkpoints").exists()
    (listed,) = [
        x.split(f"outputs in {run}/ (")[1].rstrip(")") for x in out.splitlines() if "outputs in" in x
    ]
    assert {"metrics.jsonl", "sft/", "sft-checkpoints/", "summary.json"} <= set(listed.split(", "))
    assert "checkpoints/" not in listed.split(", ")


@needs_loop
def test_summary_time_covers_the_whole_run_and_samples_are_logged(config, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", str(config), "--set", f"run.output_dir={run}", "--set", "run.log_samples_every=1"]
    assert main([*argv, "--set", "train.steps=1"]) == 0
    first = json.loads((run / "summary.json").read_text())
    assert main([*argv, "--resume"]) == 0
    second = json.loads((run / "summary.json").read_text())
    assert second["rl_steps"] == 2
    # the resumed invocation only ran step 2 and the evaluation; the summary counts the first invocation too
    assert second["elapsed_s"] > first["elapsed_s"] and second["minutes"] * 60 >= first["elapsed_s"]
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [1, 2] and len(rows) == 2 * 4  # run.log_samples_count = 4
    # run.progress = true, but stderr is not a terminal here: no progress bars in the log
    err = capsys.readouterr().err
    assert "it/s" not in err and "\r" not in err
