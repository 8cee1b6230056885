"""`exactrl report`: a multi-turn run's episode metrics are drawn (a third row of panels) and summed up in text;
a single-turn run's report keeps its four panels and prints no episode lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exactrl.cli import main
from exactrl.report import episode_summary, read_metrics, report_figure

pytest.importorskip("matplotlib")


def _rows(multi_turn: bool) -> list[dict]:
    rows = [{"step": 0, "eval/accuracy": 0.3, "phase": "before_rl"}]
    for s in range(1, 4):
        r = {
            "step": s,
            "reward/mean": 0.1 * s,
            "train/accuracy": 0.1 * s,
            "response_length/mean": 40.0,
            "response_length/max": 44.0,
            "mismatch/num_mismatched_tokens": 0,
        }
        if multi_turn:  # what exactrl.envs.rollout.episode_metrics logs
            r |= {
                "env/episodes": 8.0,
                "env/turns_mean": 1.5 + 0.25 * s,
                "env/tool_calls_mean": 0.5 * s,
                "env/tool_calls": 4.0 * s,
                "env/tool_errors_mean": 0.125,
                "env/tool_errors": 1.0,
                "env/errors": 0.0,
                "env/timeouts": 1.0 if s == 2 else 0.0,
                "env/time_s": 0.2 * s,
                "env/observation_tokens_mean": 10.0 + s,
            }
        rows.append(r)
    return rows


def _write(d: Path, rows: list[dict]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _curves(fig) -> dict[str, list[float]]:
    """Every plotted line by its label, on every axis (twin axes included)."""
    return {ln.get_label(): list(ln.get_ydata()) for ax in fig.axes for ln in ax.get_lines()}


def test_report_draws_and_sums_up_the_episodes(tmp_path, capsys):
    rows = _rows(multi_turn=True)
    fig = report_figure(rows)
    titles = [ax.get_title() for ax in fig.axes]
    assert "multi-turn episodes" in titles and "environment" in titles
    c = _curves(fig)
    assert c["turns per episode"] == [1.75, 2.0, 2.25]
    assert c["tool calls per episode"] == [0.5, 1.0, 1.5]
    assert c["tool errors per episode"] == [0.125] * 3
    assert c["observation tokens per episode"] == [11.0, 12.0, 13.0]
    assert c["environment time, summed over the episodes (s)"] == pytest.approx([0.2, 0.4, 0.6])

    lines = episode_summary(rows)
    assert lines[0].startswith("multi-turn episodes (3 RL steps)")
    turns = next(x for x in lines if "turns per episode" in x)
    assert "1.750 ->" in turns and "2.250" in turns and "(2.000)" in turns
    assert "24 episodes, 24 tool calls (3 failed), 0 environment errors, 1 timeouts" in lines[-1]

    run = _write(tmp_path / "mt", rows)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "tool calls per episode" in out and (run / "report.png").is_file()


def test_single_turn_report_has_no_episode_panels(tmp_path):
    rows = _rows(multi_turn=False)
    fig = report_figure(rows)
    assert len(fig.axes) == 4 and "multi-turn episodes" not in [ax.get_title() for ax in fig.axes]
    assert episode_summary(rows) == []
    assert read_metrics(_write(tmp_path / "st", rows)) == rows


def test_mode_panels_draw_moe_and_off_policy_metrics():
    """A mixture of experts' router metrics (as exactrl.train.router.router_metrics names them) and off-policy
    staleness get a panel each; a run without them gets none (the test above)."""
    import torch

    from exactrl.train.router import router_metrics

    rows = _rows(multi_turn=False)
    for r in rows[1:]:
        stats = torch.tensor([[3.0, 1.0, 0.0, 2.0, 1.5, 6.0]], dtype=torch.float64) * r["step"]
        r |= router_metrics(stats) | {"moe/aux_loss": 0.01 * r["step"]}
    fig = report_figure(rows)
    titles = [ax.get_title() for ax in fig.axes]
    assert "mixture of experts (router)" in titles and not any(t.startswith("off-policy") for t in titles)
    c = _curves(fig)
    assert c["busiest expert's load / mean"] == [2.0] * 3 and c["load-balancing loss"] == [0.01, 0.02, 0.03]
    for r in rows[1:]:
        r |= {"offpolicy/versions_behind/token_mean": 0.5, "offpolicy/versions_behind/max": 1.0}
    titles = [ax.get_title() for ax in report_figure(rows).axes]
    assert "off-policy (staleness, importance weights)" in titles
