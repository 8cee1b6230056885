"""The exactness guard: what a run leaves when rollout and trainer logprobs differ (report.py), the replay of
such a report (replay.py, `exactrl parity --replay`), the layer probe (layers.py), and exact-vs-fast twin runs
(twin.py, `exactrl twin`)."""

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
