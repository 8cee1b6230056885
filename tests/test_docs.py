from pathlib import Path

from exactrl.config import config_reference_markdown
from exactrl.docs_gen import render_readme

ROOT = Path(__file__).resolve().parents[1]


def test_readme_config_reference_is_current():
    text = (ROOT / "README.md").read_text()
    assert render_readme(text) == text, "run `python -m exactrl.docs_gen` to refresh the README"
    assert (ROOT / "docs" / "config.md").read_text() == config_reference_markdown()


def test_readme_has_exactly_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
