"""What a new user meets at the command line: `generate` never drops a prompt silently, a refused output folder
or a full disk is one line naming the path, and relative paths resolve one way (from the working directory)."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import pytest

from exactrl.cli import main
from exactrl.config import ConfigError, load_config
from exactrl.model.files import OutputError, writing

# A few-second run of the tiny preset (no warm start, one step of 8 rollouts).
SMALL_TOML = """
[run]
device = "cpu"
progress = false
tensorboard = false
report = false

[model]
preset = "tiny"

[engine]
max_model_len = 64

[sampling]
max_tokens = 3

[task]
name = "arithmetic"
use_chat_template = false
num_eval = 4
max_prompt_tokens = 16

[algorithm]
group_size = 4
rollouts_per_step = 8

[train]
steps = 1
"""


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: on a shared 2-core machine a tiny run is several times faster so."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


# --- generate: every prompt is generated or refused by name ------------------------------------------------


def test_generate_refuses_a_prompt_over_max_model_len_and_runs_the_others(capsys):
    long = "7" * 300  # the byte tokenizer: one token per character
    argv = ["generate", "--preset", "tiny", "--prompt", long, "--prompt", "1+1=", "--max-tokens", "2"]
    rc = main([*argv, "--max-model-len", "100", "--json"])
    out = capsys.readouterr()
    assert rc == 1
    assert [r["prompt"] for r in _json_lines(out.out)] == ["1+1="]  # the other prompt was generated
    assert "prompt 1 of 2" in out.err and "300 tokens" in out.err and "max_model_len (100)" in out.err
    assert "raise --max-model-len; the model has 2048 positions" in out.err and "Traceback" not in out.err


def test_generate_refuses_a_prompt_past_the_models_positions_and_runs_the_others(capsys):
    """--max-model-len above the model's max_position_embeddings (2048 for tiny): the longer prompt is refused
    by the engine's admission, not failed inside a step with every other prompt of the call."""
    argv = ["generate", "--preset", "tiny", "--prompt", "1+1=", "--prompt", "7" * 2100, "--max-tokens", "2"]
    rc = main([*argv, "--max-model-len", "4096", "--json"])
    out = capsys.readouterr()
    assert rc == 1
    assert [r["prompt"] for r in _json_lines(out.out)] == ["1+1="]
    assert "prompt 2 of 2" in out.err and "2100 tokens" in out.err
    assert "max_position_embeddings (2048)" in out.err and "shorten the prompt" in out.err


def test_generate_without_a_prompt_is_a_usage_error(tmp_path, capsys):
    assert main(["generate", "--preset", "tiny"]) == 2
    assert "no prompt to generate from" in capsys.readouterr().err
    blank = tmp_path / "prompts.txt"
    blank.write_text("\n  \n")
    assert main(["generate", "--preset", "tiny", "--prompts-file", str(blank)]) == 2
    err = capsys.readouterr().err
    assert "no prompt" in err and str(blank) in err


def test_generate_with_an_environment_reports_a_refused_prompt(capsys):
    argv = ["generate", "--preset", "tiny", "--env", "guess", "--prompt", "7" * 300, "--prompt", "Guess:"]
    rc = main(
        [
            *argv,
            "--answer",
            "3",
            "--answer",
            "3",
            "--max-turns",
            "1",
            "--max-tokens",
            "2",
            "--max-episode-tokens",
            "100",
        ]
    )
    out = capsys.readouterr()
    assert rc == 1
    assert "Guess:" in out.out and "prompt 1 of 2" in out.err and "300 tokens" in out.err
    assert "raise --max-episode-tokens" in out.err


# --- output folders and full disks: one line that names the path ------------------------------------------


def _small_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL_TOML)
    return cfg


def test_train_into_an_output_dir_that_cannot_be_made_names_it(tmp_path, capsys):
    (tmp_path / "afile").write_text("not a folder")
    out_dir = tmp_path / "afile" / "run"
    rc = main(["train", str(_small_config(tmp_path)), "--set", f"run.output_dir={out_dir}"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "cannot write the run directory" in err and str(out_dir) in err and "Not a directory" in err


def test_a_full_disk_while_writing_a_checkpoint_names_the_checkpoint(tmp_path, capsys, monkeypatch):
    """No space left during a write carries no file name (the OS says it of a write, not of an open): the
    checkpoint region adds it."""
    import exactrl.model.hf as hf

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "save_file", full)
    out_dir = tmp_path / "run"
    rc = main(["train", str(_small_config(tmp_path)), "--set", f"run.output_dir={out_dir}"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert "No space left on device" in err and str(out_dir / "checkpoints") in err


def test_a_full_disk_while_logging_metrics_names_the_file(tmp_path, monkeypatch):
    import exactrl.train.logging as logging_mod

    logger = logging_mod.MetricsLogger(tmp_path, tensorboard=False)

    class FullFile:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(logging_mod, "open", lambda *a, **k: FullFile(), raising=False)
    with pytest.raises(OutputError) as info:
        logger.log({"step": 1, "loss": 0.5})
    assert str(tmp_path / "metrics.jsonl") in str(info.value) and "No space left" in str(info.value)


def test_writing_names_serializer_failures_and_passes_other_errors_through(tmp_path):
    target = tmp_path / "ckpt"
    # torch.save's zip writer on a full disk: a RuntimeError without a path
    with pytest.raises(OutputError, match=r"cannot write the checkpoint .*ckpt: the write failed"):
        with writing(target, "the checkpoint"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    # a file name the OS gave is kept (it is more precise than the region's)
    with pytest.raises(OutputError, match=r"x\.json: Permission denied"):
        with writing(target, "the checkpoint"):
            raise PermissionError(errno.EACCES, "Permission denied", str(target / "x.json"))
    # anything else is not an output error and keeps its own type and traceback
    with pytest.raises(RuntimeError, match="CUDA error"):
        with writing(target, "the checkpoint"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_report_into_an_unwritable_path_names_it(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5, "loss": 0.1}) + "\n")
    (tmp_path / "afile").write_text("")
    rc = main(["report", str(run), "--out", str(tmp_path / "afile" / "r.png")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert "cannot write the report" in err and "afile" in err


# --- relative paths: from the working directory, and a path only next to the config is refused -------------


@pytest.fixture()
def project(tmp_path, monkeypatch) -> Path:
    """A project folder (the working directory) with its config in configs/. A module `myenv` that an earlier
    test of this process imported (the README's multi-turn example), or a folder of one on sys.path, would make
    `myenv:Hint` importable as installed: neither is left to this test."""
    (tmp_path / "configs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "myenv", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "myenv.py").exists()])
    return tmp_path


@pytest.mark.parametrize(
    "key, value, made",
    [
        ("task.path", "data/train.jsonl", "data/train.jsonl"),
        ("task.eval_path", "data/test.jsonl", "data/test.jsonl"),
        ("model.path", "ckpt/model", "ckpt/model"),
        ("model.tokenizer", "tok/tokenizer.json", "tok/tokenizer.json"),
        ("sft.checkpoint", "runs/a/sft", "runs/a/sft"),
        ("lora.path", "adapters/a", "adapters/a"),
        ("reward.model", "rm/model", "rm/model"),
        ("reward.functions", "my_rewards.py:correct", "my_rewards.py"),
        ("env.name", "myenv:Hint", "myenv.py"),
    ],
)
def test_a_path_only_next_to_the_config_is_refused_with_the_path_to_write(project, key, value, made):
    written = json.dumps([value]) if key == "reward.functions" else json.dumps(value)
    section, name = key.split(".")
    extra = "rank = 4\n" if key == "lora.path" else ""
    (project / "configs" / "run.toml").write_text(f"[{section}]\n{name} = {written}\n{extra}")
    target = project / "configs" / made
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("")
    overrides = [] if key == "model.path" else ["model.preset=tiny"]  # preset and path exclude each other
    if key == "sft.checkpoint":
        overrides.append("sft.steps=0")
    if key == "task.path":
        overrides.append("task.name=jsonl")
    with pytest.raises(ConfigError) as info:
        load_config("configs/run.toml", overrides)
    msg = str(info.value)
    assert info.value.key == key and "working directory" in msg
    if not made.endswith("myenv.py"):
        assert f"configs/{made}" in msg  # the path to write instead
    # The same file in the working directory: that one is meant, and nothing is refused.
    (project / made).parent.mkdir(parents=True, exist_ok=True)
    (project / made).write_text("")
    load_config("configs/run.toml", overrides)


def test_paths_from_the_working_directory_load(project):
    """task.path written in a config under configs/ names data/ of the working directory (as the recipes do)."""
    (project / "data").mkdir()
    (project / "data" / "train.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (project / "configs" / "run.toml").write_text('[task]\nname = "jsonl"\npath = "data/train.jsonl"\n')
    cfg = load_config("configs/run.toml", ["model.preset=tiny"])
    assert cfg.task.path == "data/train.jsonl" and Path(cfg.task.path).is_file()


REWARD_ONE = "def score(completion, answer, example):\n    return 1.0\n"
REWARD_ZERO = "def score(completion, answer, example):\n    return 0.0\n"


def test_train_takes_the_reward_file_of_the_working_directory(project, capsys):
    """A reward file of the same name in the working directory and next to the config: the working
    directory's is the one scored (it returns 1.0 for every completion; the config's neighbour 0.0)."""
    (project / "configs" / "small.toml").write_text(SMALL_TOML + '\n[reward]\nfunctions = ["rw.py:score"]\n')
    (project / "rw.py").write_text(REWARD_ONE)
    (project / "configs" / "rw.py").write_text(REWARD_ZERO)
    out_dir = project / "runs" / "r"
    assert main(["train", "configs/small.toml", "--set", f"run.output_dir={out_dir}"]) == 0
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r and r.get("step", 0) >= 1]
    assert rewards and all(r == 1.0 for r in rewards)


def test_a_missing_checkpoint_names_the_run_s_checkpoints(tmp_path, monkeypatch, capsys):
    """The README's eval line with another step than the run wrote: the error lists the steps there are."""
    (tmp_path / "runs" / "q" / "checkpoints" / "step-000020" / "policy").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    rc = main(["eval", "--no-run-config", "--model", "runs/q/checkpoints/step-000200/policy"])
    err = capsys.readouterr().err
    assert rc == 2 and "no such directory" in err and "holds step-000020" in err
