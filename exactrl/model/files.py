"""Checkpoint and output files with errors that name the file: reading the small files of a checkpoint directory
(and the JSON position), and the `writing` region every output goes through (no space, no permission)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
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


class OutputError(OSError):
    """Writing an output failed (no space left, no permission, a read-only disk, a file where a folder should
    be); the message names what was being written and the path."""

    def __init__(self, what: str, path: str | Path, reason: str, errno_: int | None = None) -> None:
        super().__init__(errno_, reason, str(path))
        self.what = what

    def __str__(self) -> str:
        return f"cannot write {self.what} {self.filename}: {self.strerror}"


# A serializer's own error for a failed write (torch.save's zip writer, safetensors' Rust writer): raised as
# RuntimeError / SafetensorError with no path in it. Recognised by these phrases only, so that a real bug inside
# a write region (a CUDA error while copying a tensor out) keeps its own exception and traceback.
_WRITE_FAILURE_PHRASES = ("I/O error", "inline_container", "file write failed", "No space left")


@contextmanager
def writing(path: str | Path, what: str) -> Iterator[None]:
    """The writes of one output (a run directory, a checkpoint, metrics.jsonl) under one name: an OS error
    comes out as OutputError naming the file it carries or, for a failure with none (no space left during a
    write), `path`."""
    try:
        yield
    except OutputError:
        raise  # an inner region already named it
    except OSError as e:
        where = e.filename if e.filename is not None else path
        if e.filename2 is not None:
            where = f"{where} -> {e.filename2}"
        raise OutputError(what, where, e.strerror or str(e), e.errno) from e
    except Exception as e:
        text = str(e)
        if not any(phrase in text for phrase in _WRITE_FAILURE_PHRASES):
            raise
        first = text.splitlines()[0] if text else ""
        raise OutputError(
            what, path, f"the write failed ({type(e).__name__}: {first}){_free_space(path)}"
        ) from e


def _free_space(path: str | Path) -> str:
    """'; N bytes free on its disk', for a failure whose message does not say why (usually a full disk)."""
    import shutil

    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return f"; {shutil.disk_usage(p).free:,} bytes free on its disk"
    except OSError:
        return ""
