"""Every command that computes on CUDA caps the host's intra-op threads before its own code runs
(`exactrl.cli.cap_host_threads`, the rule of `limit_host_threads`): `bench train` once ran at half speed on a
shared host because only the torchrun path capped them. Each command's first step is replaced by a probe that
records the thread count it sees and stops the command there (no model loads, no GPU is needed)."""

from __future__ import annotations

import os

import pytest
import torch

from exactrl import cli
from exactrl.distributed.env import HOST_THREADS_CUDA

CONFIG = "configs/quickstart.toml"


class _Seen(Exception):
    pass


def _probe(seen: list[int]):
    def probe(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise _Seen

    return probe


# (command line, the module attribute the command calls first, before any device work)
COMMANDS = {
    "train": (["train", CONFIG, "--set", "run.device=cuda"], "exactrl.train.resolved.resolve_run"),
    "sft": (["sft", CONFIG, "--set", "run.device=cuda"], "exactrl.train.resolved.resolve_run"),
    "twin": (["twin", CONFIG, "--set", "run.device=cuda"], "exactrl.guard.twin.run_twin"),
    "eval": (
        ["eval", "--model", "MODEL", "--device", "cuda", "--no-run-config"],
        "exactrl.model.loading.load_policy",
    ),
    "eval-run-config": (["eval", "--model", "MODEL", "--config", "CFG"], "exactrl.model.loading.load_policy"),
    "generate": (["generate", "--prompt", "1+1=", "--device", "cuda"], "exactrl.model.loading.load_policy"),
    "parity": (["parity", "--device", "cuda"], "exactrl.ops.set_exact_environment"),
    "bench-rollout": (["bench", "rollout", "--device", "cuda"], "exactrl.bench.bench_rollout"),
    "bench-train": (["bench", "train", "--device", "cuda"], "exactrl.bench.bench_train"),
    "bench-train-fsdp": (["bench", "train", "--fsdp", "--device", "cuda"], "exactrl.bench.bench_train_fsdp"),
    "bench-rl": (["bench", "rl", "--set", "run.device=cuda"], "exactrl.bench_rl.run_bench"),
}


@pytest.fixture
def many_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(HOST_THREADS_CUDA + 2)
    yield HOST_THREADS_CUDA + 2
    torch.set_num_threads(before)


def _run(monkeypatch, tmp_path, argv: list[str], target: str) -> list[int]:
    module, _, name = target.rpartition(".")
    seen: list[int] = []
    monkeypatch.setattr(__import__(module, fromlist=[name]), name, _probe(seen))
    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\ndevice = "cuda"\n')
    argv = [str(tmp_path) if a == "MODEL" else str(cfg) if a == "CFG" else a for a in argv]
    argv += ["--set", f"run.output_dir={tmp_path / 'run'}"] if argv[0] in ("train", "sft", "twin") else []
    if argv[:3] == ["bench", "train", "--fsdp"]:  # the FSDP step runs on a torchrun rank (its own launch)
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(k, v)
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with pytest.raises(_Seen):
        cli._main(argv)
    return seen


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_cuda_command_caps_the_host_threads(command, many_threads, monkeypatch, tmp_path):
    argv, target = COMMANDS[command]
    assert _run(monkeypatch, tmp_path, argv, target) == [HOST_THREADS_CUDA]


def test_a_cpu_run_and_omp_num_threads_keep_their_threads(many_threads, monkeypatch, tmp_path):
    argv = ["train", CONFIG, "--set", "run.device=cpu"]
    assert _run(monkeypatch, tmp_path, argv, "exactrl.train.resolved.resolve_run") == [many_threads]
    argv = ["bench", "train", "--device", "cpu"]
    assert _run(monkeypatch, tmp_path, argv, "exactrl.bench.bench_train") == [many_threads]
    monkeypatch.setenv("OMP_NUM_THREADS", str(many_threads))  # the user's (or torchrun's) choice stands
    argv, target = COMMANDS["bench-train"]
    assert _run(monkeypatch, tmp_path, argv, target) == [many_threads]
