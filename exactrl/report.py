"""`exactrl report`'s names, where the commands and tests import them from. The report is drawn by the training
loop at the end of every run too, so it lives in the training layer (exactrl/train/run_report.py)."""

from exactrl.train.run_report import (
    EPISODE_METRICS,
    MODE_PANELS,
    accuracy_label,
    draw_report,
    episode_summary,
    is_multi_turn,
    read_metrics,
    report_figure,
)

__all__ = [
    "EPISODE_METRICS",
    "MODE_PANELS",
    "accuracy_label",
    "draw_report",
    "episode_summary",
    "is_multi_turn",
    "read_metrics",
    "report_figure",
]
