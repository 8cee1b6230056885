"""`ConfigError` and the small checks every section's `validate` uses."""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A configuration is malformed: unknown key, wrong type, or a failed validation check.

    ``key`` is the dotted name of the offending field (``"train.lr"``) when there is one.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# ----------------------------------------------------------------------------------------------------------
# Schema


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"{key} {message}", key=key)


def _check_positive(value: float, key: str) -> None:
    if not (math.isfinite(value) and value > 0):
        _fail(key, f"must be > 0, got {value!r}")


def _check_nonneg(value: float, key: str) -> None:
    if not (math.isfinite(value) and value >= 0):
        _fail(key, f"must be >= 0, got {value!r}")


def _check_at_least(value: int, minimum: int, key: str) -> None:
    if value < minimum:
        _fail(key, f"must be >= {minimum}, got {value!r}")
