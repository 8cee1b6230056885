"""The mismatch report's names, where the guard's readers have always imported them from. The report is written by
the training loop, so it lives in the training layer (exactrl/train/mismatch_report.py); the guard reads it."""

from exactrl.train.mismatch_report import (
    MAX_PROBED_SEQUENCES,
    REPORT_FORMAT,
    MismatchSequence,
    RecordedSequence,
    abort_message,
    floats_from_hex,
    format_mismatch_error,
    hex_floats,
    read_mismatch_report,
    sampling_record,
    write_mismatch_report,
)

__all__ = [
    "MAX_PROBED_SEQUENCES",
    "REPORT_FORMAT",
    "MismatchSequence",
    "RecordedSequence",
    "abort_message",
    "floats_from_hex",
    "format_mismatch_error",
    "hex_floats",
    "read_mismatch_report",
    "sampling_record",
    "write_mismatch_report",
]
