"""A command's error line reaches stderr in one write: the ranks of a plain torchrun launch share one stderr (an
unbuffered, write-through stream), and print's text and newline as two writes let two ranks' errors run into one
line (seen in test_multirank's unshared-run-directory launch)."""

from __future__ import annotations

import io

from exactrl import cli


class Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_an_error_line_is_one_write(monkeypatch):
    monkeypatch.delenv("EXACTRL_RANK_ERRORS", raising=False)
    err = Writes()
    monkeypatch.setattr(cli.sys, "stderr", err)
    cli._say_error("exactrl train (rank 1): error: something named", 2)
    assert err.calls == ["exactrl train (rank 1): error: something named\n"]
