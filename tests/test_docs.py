import json
import re
import shlex
import shutil
import textwrap
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


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def _tour_commands() -> list[list[str]]:
    """The command lines of the README's "Tour of the CLI" block, as argv lists (a `[--a | --b]` alternative and
    the comment dropped)."""
    block = _section((ROOT / "README.md").read_text(), "## Tour of the CLI").split("```")[1]
    lines = []
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", re.sub(r"\[[^\]]*\|[^\]]*\]", "", line)).strip()
        if line.startswith("exactrl "):
            lines.append(shlex.split(line)[1:])
    return lines


def test_readme_tour_commands_parse_with_todays_cli(monkeypatch):
    """Every line of the tour names a command and flags the CLI has (each command's function is replaced by one
    that records its arguments: nothing runs), and the eval lines name the checkpoint the train line writes."""
    from exactrl import cli, commands

    seen: list[str] = []
    for mod, names in (
        (cli, ["cmd_init_model", "cmd_generate", "cmd_parity"]),
        (commands, ["cmd_train", "cmd_sft", "cmd_plan", "cmd_eval", "cmd_report", "cmd_bench"]),
    ):
        for name in names:
            monkeypatch.setattr(mod, name, lambda args, _n=name: seen.append(_n) or 0)
    tour = _tour_commands()
    assert len(tour) >= 10
    for argv in tour:
        assert cli.main(argv) == 0, argv
    assert len(seen) == len(tour)
    (train,) = [a for a in tour if a[0] == "train"]
    steps = int(train[train.index("--set") + 1].split("=")[1])
    for argv in (a for a in tour if a[0] == "eval"):
        assert f"checkpoints/step-{steps:06d}/" in argv[argv.index("--model") + 1], argv


def test_readme_multi_turn_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The "Multi-turn episodes with your own environment" section: its myenv.py and its command, run from a
    folder that holds both and configs/ (as it says), shortened only by more --set keys after its own."""
    section = _section((ROOT / "README.md").read_text(), "## Multi-turn episodes with your own environment")
    code = section.split("```python")[1].split("```")[0]
    assert code.lstrip().startswith("# myenv.py")
    (tmp_path / "myenv.py").write_text(textwrap.dedent(code))
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "quickstart.toml", tmp_path / "configs" / "quickstart.toml")
    command = re.search(
        r"`(exactrl train configs/quickstart\.toml --set env\.name=myenv:Hint[^`]*)`", section
    )
    assert command, "the section's command line"
    argv = shlex.split(command.group(1).replace("\n", " "))[1:]
    short = ["sft.steps=2", "train.steps=1", "train.warmup_steps=0", "algorithm.rollouts_per_step=8"]
    short += ["algorithm.group_size=4", "task.num_eval=4", "run.progress=false", "run.tensorboard=false"]
    short += [f"run.output_dir={tmp_path / 'run'}"]
    monkeypatch.chdir(tmp_path)
    import torch

    from exactrl.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny run on a shared machine: one thread is faster
    try:
        rc = main(argv + [x for s in short for x in ("--set", s)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "env/turns_mean" in r)
    assert step["env/turns_max"] >= 2  # the hint came back and the model answered again
    assert step["mismatch/num_mismatched_tokens"] == 0
