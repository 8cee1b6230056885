"""Reading the small files of a checkpoint directory with errors that name the file (and the JSON position)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, malformed or points outside its directory; the message names
    the file."""


def read_json(path: Path) -> Any:
    """Parse a JSON file; a syntax error names the file, line and column, a decoding error the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
