"""The exactness guard: the replay of a mismatch report (replay.py, `exactrl parity --replay`) and exact-vs-fast
twin runs (twin.py, `exactrl twin`). The report itself and the layer probe are written by the training loop, so
they live in the training layer (exactrl/train/mismatch_report.py, exactrl/train/layer_probe.py); report.py and
layers.py here keep their names importable."""

from exactrl.guard.report import (
    MismatchSequence,
    abort_message,
    format_mismatch_error,
    read_mismatch_report,
    sampling_record,
    write_mismatch_report,
)

__all__ = [
    "MismatchSequence",
    "abort_message",
    "format_mismatch_error",
    "read_mismatch_report",
    "sampling_record",
    "write_mismatch_report",
]
