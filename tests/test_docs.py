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


RESULTS = ROOT / "benchmarks" / "results"
# A record's name as the docs write it: ends in a device or host mark and a record suffix, a `{a,b}` alternative
# allowed anywhere (expanded to every combination).
RECORD_NAME = re.compile(r"[\w.{},-]*(?:NVIDIA|H100|H200|-cpu)[\w.{},-]*\.(?:\{[a-z,]+\}|jsonl|json|txt|png)")


def _expand(name: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[: m.start()] + alt + name[m.end() :])]


def _cited_records() -> set[str]:
    texts = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))] + [(ROOT / "README.md").read_text()]
    return {x for text in texts for name in RECORD_NAME.findall(text) for x in _expand(name.split("/")[-1])}


def test_the_docs_cite_only_records_that_exist_and_every_record_is_cited():
    """benchmarks/results/ holds the records the docs cite, no more (the tests may cite one too), and a record the
    docs name exists under that name."""
    cited = _cited_records()
    have = {p.name for p in RESULTS.iterdir()}
    assert cited - have == set(), (
        f"the docs cite records that are not in benchmarks/results/: {sorted(cited - have)}"
    )
    tests = "".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    uncited = sorted(n for n in have - cited if n not in tests)
    assert not uncited, f"records no doc or test cites (cite them or delete them): {uncited}"


def test_no_work_session_in_docs_benchmarks_configs_or_result_names():
    """The word "session" in the sense of a work session (the project's history) stays out of what users read
    and run; the engine's "multi-turn session" is the one sense allowed."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").iterdir())]
    paths += [p for p in sorted((ROOT / "benchmarks").rglob("*")) if p.is_file()]
    found = []
    for p in paths:
        if "session" in p.name.lower():
            found.append(str(p.relative_to(ROOT)))
        if p.suffix in (".md", ".toml", ".py", ".sh"):
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if re.search(r"session", re.sub(r"multi-turn sessions?", "", line), re.IGNORECASE):
                    found.append(f"{p.relative_to(ROOT)}:{i}")
    assert not found, f"the word session outside the engine's sense: {found}"


def test_every_gpu_sh_target_is_documented():
    """benchmarks/gpu.sh parses, and each of its targets is in its usage lines and in docs/benchmarks.md's table."""
    import subprocess

    script = ROOT / "benchmarks" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    targets = re.findall(r"^  ([a-z][a-z-]*)\)$", text, re.MULTILINE)
    assert len(targets) >= 4, targets
    usage = text.split("set -uo pipefail")[0]
    table = _section((ROOT / "docs" / "benchmarks.md").read_text(), "## Running the GPU suites")
    for t in targets:
        assert f"#   {t} " in usage, f"gpu.sh's usage lines do not name its target {t}"
        assert f"| `{t}` |" in table, f"docs/benchmarks.md's gpu.sh table does not name the target {t}"
