"""Keep the README's configuration reference in step with the dataclass docstrings.

`python -m exactrl.docs_gen` rewrites the block between the config-reference markers in README.md and
docs/config.md; a test fails when they are stale."""

from __future__ import annotations

import sys
from pathlib import Path

from exactrl.config import config_reference_markdown

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def reference_block() -> str:
    body = config_reference_markdown()
    # The README has its own section heading: drop the generated top-level title.
    lines = body.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join(lines).strip() + "\n"


def render_readme(text: str) -> str:
    if START not in text or END not in text:
        raise ValueError("README.md has no config-reference markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{reference_block()}{END}{tail}"


def main(root: str = ".") -> int:
    root_p = Path(root)
    readme = root_p / "README.md"
    readme.write_text(render_readme(readme.read_text()))
    (root_p / "docs" / "config.md").write_text(config_reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
