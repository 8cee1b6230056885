"""Slow phases say what they do (exactrl/progress.py): off a terminal a line once a phase has run SHOW_AFTER_S, a
heartbeat while it runs and one at its end; on a terminal a bar; a quick phase says nothing."""

from __future__ import annotations

import io
import time

import pytest

import exactrl.progress as progress
from exactrl.model.hf import save_model
from exactrl.model.loading import load_policy
from exactrl.progress import Progress, amount


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_quick_phase_says_nothing(capsys: pytest.CaptureFixture) -> None:
    load_policy(preset_name="tiny")
    assert capsys.readouterr().err == ""


def test_model_build_and_load_print_progress_lines(
    tmp_path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)  # every phase counts as slow
    model, tok = load_policy(preset_name="tiny")
    n = sum(p.numel() for p in model.parameters())
    err = capsys.readouterr().err
    assert "random weights of tiny (" in err and "float32, cpu): done, " in err, err
    assert f"{amount(n, 'params')} in" in err
    save_model(model, tmp_path / "ckpt", tokenizer=tok)
    capsys.readouterr()
    load_policy(path=tmp_path / "ckpt")
    err = capsys.readouterr().err
    assert f"loading {tmp_path / 'ckpt'} (" in err and f"done, {amount(n, 'params')} in" in err, err


def test_a_long_call_without_updates_still_shows_the_process_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.05)
    monkeypatch.setattr(progress, "EVERY_S", 0.05)
    out = io.StringIO()
    with Progress("capturing", 2, "graphs", stream=out) as bar:
        time.sleep(0.4)  # one long call: the heartbeat speaks meanwhile
        bar.update(2)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3 and lines[0].startswith("capturing: 0% (0 of 2 graphs), ")
    assert lines[-1].startswith("capturing: done, 2 graphs in ")
    out = io.StringIO()
    with pytest.raises(RuntimeError), Progress("loading", 4, "params", stream=out) as bar:
        time.sleep(0.2)
        raise RuntimeError("disk")
    assert (
        out.getvalue().splitlines()[-1].startswith("loading: stopped by RuntimeError at 0% (0 of 4 params)")
    )


def test_a_terminal_gets_a_bar_and_other_ranks_say_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    tty = _Tty()
    with Progress("random weights", 10, "params", stream=tty) as bar:
        bar.update(10)
    assert "random weights" in tty.getvalue() and "\r" in tty.getvalue()
    monkeypatch.setenv("RANK", "1")
    out = io.StringIO()
    with Progress("random weights", 10, "params", stream=out) as bar:
        time.sleep(0.1)
        bar.update(10)
    assert out.getvalue() == ""
