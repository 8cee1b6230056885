"""Logs a user can read: no progress bars off a terminal, samples.jsonl, clear messages for missing packages."""

from __future__ import annotations

import io
import json
import sys

import pytest

from exactrl.config import RunConfig, apply_overrides
from exactrl.train.logging import MetricsLogger, _NoBar, import_wandb, progress_bar, wandb_mode


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_on_a_terminal():
    log = io.StringIO()
    bar = progress_bar(10, "step 1 generate", stream=log)
    assert isinstance(bar, _NoBar)
    for _ in range(10):
        bar.update(1)
    bar.set_postfix(loss="1.0")
    bar.close()
    assert log.getvalue() == ""  # nothing, where tqdm would write carriage-return redraws into the log file
    tty = FakeTTY()
    bar = progress_bar(10, "step 1 generate", stream=tty)
    bar.update(3)
    bar.close()
    assert "step 1 generate" in tty.getvalue()
    assert isinstance(progress_bar(10, "x", enabled=False, stream=FakeTTY()), _NoBar)


def test_samples_go_to_jsonl_and_tensorboard_text(tmp_path):
    pytest.importorskip("tensorboard")
    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log_samples(3, ["1+1=", "2|2="], ["2", "x\ny"], [1.0, 0.0], answers=["2", "4"])
    logger.log({"step": 3, "loss": 0.5})
    logger.close()
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 3, "prompt": "1+1=", "completion": "2", "reward": 1.0, "answer": "2"},
        {"step": 3, "prompt": "2|2=", "completion": "x\ny", "reward": 0.0, "answer": "4"},
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "1+1=" in text and "2\\|2=" in text
    # a resumed run drops samples logged after its checkpoint, like metrics
    logger = MetricsLogger(tmp_path, tensorboard=False, resume=True)
    logger.log_samples(5, ["p"], ["c"], [0.5])
    logger.truncate_after(3)
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [3, 3]


def test_missing_tensorboard_is_a_warning_not_silence(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    said: list[str] = []
    logger = MetricsLogger(tmp_path, tensorboard=True, warn=said.append)
    assert logger.tb is None
    (msg,) = said
    assert "run.tensorboard" in msg and "pip install tensorboard" in msg
    assert MetricsLogger(tmp_path / "b", tensorboard=False, warn=said.append).tb is None and len(said) == 1


def test_missing_wandb_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"pip install wandb.*run.wandb = false"):
        import_wandb()
    with pytest.raises(ValueError, match="pip install wandb"):
        MetricsLogger(tmp_path, tensorboard=False, wandb=True)


def test_wandb_mode_from_config_or_environment(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode(None) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode(None) == "offline" and wandb_mode("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with pytest.raises(ValueError, match="WANDB_MODE"):
        wandb_mode(None)


def test_logging_config_keys_validate():
    cfg = apply_overrides(RunConfig(), ["model.preset=tiny", "run.wandb=true", "run.wandb_mode=offline"])
    cfg.validate()
    with pytest.raises(ValueError, match="run.log_samples_every"):
        apply_overrides(cfg, ["run.log_samples_every=-1"]).validate()


def test_the_step_line_shows_the_modes_figures_when_logged():
    """moe/* (exactrl.train.router.router_metrics's names) and the off-policy staleness and importance weights
    join the step line when the step logged them, and only then."""
    import torch

    from exactrl.train.logging import step_line
    from exactrl.train.router import router_metrics

    base = {"step": 3, "reward/mean": 0.5, "mismatch/num_mismatched_tokens": 0.0, "mismatch/num_tokens": 10.0}
    plain = step_line(base)
    assert "moe" not in plain and "behind" not in plain and plain.endswith("- s")
    moe = router_metrics(torch.tensor([[3.0, 1.0, 0.0, 2.0, 1.5, 6.0]], dtype=torch.float64))
    line = step_line(base | moe | {"moe/aux_loss": 0.0123})
    assert line.endswith("| moe load 2.00x aux 0.0123")
    off = {
        "offpolicy/versions_behind/token_mean": 0.75,
        "offpolicy/versions_behind/max": 1.0,
        "offpolicy/is_weight/mean": 1.002,
        "offpolicy/is_weight/capped_frac": 0.015,
    }
    assert step_line(base | off).endswith("| behind 0.75 (max 1) is-w 1.002 (1.5% capped)")
