"""A refusal that depends only on the command, its config and the model's shape comes before torchrun starts
anything (`exactrl.cli.check_before_launch`): a launch that would be refused by its ranks costs a user 10-20 s of
start-up first. The launcher is replaced by one that fails the test, so each case proves nothing launched."""

from __future__ import annotations

from pathlib import Path

import pytest

from exactrl import cli
from exactrl.distributed import launch

ROOT = Path(__file__).resolve().parents[2]
TINY_CPU = ["--preset", "tiny", "--device", "cpu"]
CASES = {
    "parity-ep-dense": (
        ["parity", *TINY_CPU, "--expert-parallel", "2", "--nproc", "2"],
        "engine.expert_parallel = 2: the model has no sparse (mixture-of-experts) layer",
    ),
    "parity-tp-heads": (
        ["parity", *TINY_CPU, "--tensor-parallel", "3", "--nproc", "3"],
        "engine.tensor_parallel = 3 does not divide the model's 4 attention heads",
    ),
    "parity-ep-experts": (
        ["parity", "--preset", "tiny-moe", "--device", "cpu", "--expert-parallel", "3", "--nproc", "3"],
        "engine.expert_parallel = 3 does not divide the model's",
    ),
    "parity-tp-zero": (
        ["parity", *TINY_CPU, "--tensor-parallel", "0", "--nproc", "2"],
        "error: engine.tensor_parallel = 0 must be at least 1\n",
    ),
    "bench-rl-generators": (
        ["bench", "rl", *TINY_CPU, "--generator-ranks", "2", "--nproc", "2"],
        "distributed.generator_ranks = 2 with 2 ranks leaves no rank to train",
    ),
    "bench-rl-ep-dense": (
        ["bench", "rl", *TINY_CPU, "--set", "engine.expert_parallel=2", "--nproc", "2"],
        "engine.expert_parallel = 2: the model has no sparse (mixture-of-experts) layer",
    ),
    "bench-rl-vs": (
        ["bench", "rl", *TINY_CPU, "--vs", "hf", "--nproc", "2"],
        "bench rl does not implement --vs",
    ),
    "bench-rl-workload": (
        ["bench", "rl", *TINY_CPU, "--prompt-min", "9", "--prompt-max", "8", "--nproc", "2"],
        "bench rl: --prompt-max (8) must be >= --prompt-min (9)",
    ),
    "bench-rl-steps": (["bench", "rl", *TINY_CPU, "--steps", "0", "--nproc", "2"], "--steps must be >= 1"),
    "bench-rollout-baseline": (
        ["bench", "rollout", *TINY_CPU, "--baseline", "no-such-record.json", "--nproc", "2"],
        "--baseline no-such-record.json: no such file",
    ),
    "bench-rl-baseline": (
        ["bench", "rl", *TINY_CPU, "--baseline", str(ROOT / "README.md"), "--nproc", "2"],
        "README.md: not a `bench rl` result",
    ),
    "bench-rollout-vs-torch": (
        ["bench", "rollout", *TINY_CPU, "--vs", "torch", "--nproc", "1"],
        "the torch baseline is a training step",
    ),
    "bench-train-fsdp-vs-torch": (
        ["bench", "train", *TINY_CPU, "--fsdp", "--vs", "torch", "--nproc", "1"],
        "the torch baseline is the one-device step",
    ),
}


@pytest.fixture
def no_launch(monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("torchrun was launched for a command its ranks would refuse")

    monkeypatch.setattr(launch, "launch", launched)


@pytest.mark.parametrize("case", list(CASES))
def test_a_refusal_of_the_options_or_the_model_shape_comes_before_the_launch(case, no_launch, capsys):
    argv, said = CASES[case]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


def test_the_ranks_refuse_the_same_without_the_launcher(no_launch, capsys):
    """parity on one process or under a plain torchrun runs the same check (one function): a split without ranks
    asks for --nproc; a parallel degree of 0 names its own key alone."""
    assert cli.main(["parity", *TINY_CPU, "--tensor-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert "pass --nproc N, a multiple of 2" in err and "world size" not in err, err
    assert cli.main(["parity", *TINY_CPU, "--expert-parallel", "0"]) == 2
    err = capsys.readouterr().err
    assert "engine.expert_parallel = 0 must be at least 1" in err and "tensor_parallel" not in err, err
