"""`exactrl ... --nproc N`: what fails before the launch starts nothing, and what fails on a rank is said once, by
the launcher, with that rank's exit status (exactrl.cli.check_before_launch, exactrl.distributed.launch). Each
launch is a subprocess on CPU ranks (gloo) with the tiny preset."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exactrl.cli import main
from exactrl.distributed.launch import RankError, failure_report, first_failure

ROOT = Path(__file__).resolve().parents[2]
# torchrun's report of a failed child, and its agent's log lines (`E1128 04:29:04.023000 4704 torch/...`)
TORCHRUN_NOISE = re.compile(r"Traceback|ChildFailedError|torch/distributed/|^[EWI]\d{4} ", re.M)
TINY_PARITY = ["--device", "cpu", "--num-prompts", "2", "--max-tokens", "6", "--samples-per-prompt", "2"]


def _exactrl(
    args: list[str], extra_path: Path | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *([str(extra_path)] if extra_path else []), env.get("PYTHONPATH", "")]
    )
    return subprocess.run(
        [sys.executable, "-m", "exactrl.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,  # a rank that hangs after its peer failed fails the test instead of the suite
    )


def test_a_config_error_is_said_once_and_nothing_is_launched():
    res = _exactrl(["train", "configs/quickstart.toml", "--set", "nosuch.key=1", "--nproc", "3"])
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "exactrl train: error: unknown section '[nosuch]' in --set nosuch.key=1; valid keys: run, model, engine, "
        "sampling, task, reward, algorithm, train, sft, env, lora, distributed"
    ]
    assert "launching" not in res.stderr and not TORCHRUN_NOISE.search(res.stderr)


def test_a_config_the_ranks_cannot_run_is_refused_before_launch(tmp_path):
    """What the run would refuse under torchrun (here: fewer prompts per step than ranks) and a run directory it
    would refuse are both said by the launcher."""
    out = tmp_path / "run"
    res = _exactrl(
        ["train", "configs/quickstart.toml", "--set", f"run.output_dir={out}", "--set",
         "algorithm.rollouts_per_step=8", "--set", "algorithm.group_size=4", "--nproc", "3"]
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "2 prompts per step for 3 ranks" in res.stderr and "launching" not in res.stderr
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    res = _exactrl(["train", "configs/quickstart.toml", "--set", f"run.output_dir={out}", "--nproc", "2"])
    assert res.returncode == 2 and "is not empty" in res.stderr and "launching" not in res.stderr


def test_what_a_command_cannot_do_on_several_ranks_is_refused_before_launch(capsys):
    res = _exactrl(["bench", "rollout", "--preset", "tiny", "--device", "cpu", "--vs", "hf", "--nproc", "2"])
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "exactrl bench: error: bench rollout --vs hf runs at world size 1; drop --vs or --nproc"
    ]
    # In process (nothing is launched when the table refuses): the other rows, and --nproc 1 passes the table.
    assert main(["parity", "--replay", "somewhere", "--nproc", "2"]) == 2
    assert "parity --replay recomputes a report on one process" in capsys.readouterr().err
    assert main(["bench", "train", "--preset", "tiny", "--nproc", "2"]) == 2
    assert "add --fsdp" in capsys.readouterr().err
    assert main(["bench", "rollout", "--preset", "tiny", "--concurrency", "2", "--nproc", "3"]) == 2
    assert "--concurrency 2 requests for 3 ranks" in capsys.readouterr().err
    assert main(["parity", "--num-prompts", "2", "--nproc", "3"]) == 2
    assert "--num-prompts (2) must be at least the number of ranks (3)" in capsys.readouterr().err


def test_a_failing_parity_reads_as_one_verdict_and_exits_1():
    res = _exactrl(["parity", "--nproc", "2", "--mode", "fast", *TINY_PARITY])
    assert res.returncode == 1, res.stderr
    assert res.stderr.count("FAIL (") == 1, res.stderr
    assert not TORCHRUN_NOISE.search(res.stderr), res.stderr
    assert res.stdout.count("fast   cpu") == 1  # the table, from rank 0 alone


PLANT = """
import json
import os
if os.environ.get("RANK") == "1":
    import exactrl.parity as parity

    def run_parity(*args, **kwargs):
        raise {error}("planted on rank 1")

    parity.run_parity = run_parity  # rank 0 waits for rank 1 inside its first collective
"""


@pytest.mark.parametrize(
    ("error", "status", "said"),
    [
        ("ValueError", 2, ["exactrl parity (rank 1): error: planted on rank 1"]),
        pytest.param(
            "RuntimeError",
            1,
            ["exactrl parity (rank 1) failed:", "Traceback (most recent call last):"],
            marks=pytest.mark.extended,  # the ValueError case's path, with a traceback: make test-all
        ),
    ],
)
def test_a_rank_error_is_said_once_with_its_exit_status_and_stops_the_other_ranks(
    tmp_path, error, status, said
):
    """Rank 1 fails while rank 0 waits for it in a collective: the run stops (no hang: `timeout`), rank 1's error
    is printed once (a crash with its traceback, once), and the launcher exits with rank 1's status."""
    (tmp_path / "sitecustomize.py").write_text(PLANT.format(error=error))  # every rank's interpreter loads it
    res = _exactrl(["parity", "--nproc", "2", *TINY_PARITY], extra_path=tmp_path, timeout=240)
    assert res.returncode == status, res.stderr
    lines = res.stderr.splitlines()
    start = lines.index(said[0])
    assert lines[start : start + len(said)] == said, res.stderr
    assert res.stderr.count(": planted on rank 1") == 1, res.stderr  # the message once (not the `raise` line)
    assert res.stderr.count("Traceback") == (error == "RuntimeError"), res.stderr
    assert "ChildFailedError" not in res.stderr and not re.search(r"^[EW]\d{4} ", res.stderr, re.M)


def test_the_first_failure_is_the_earliest_rank_error_else_a_rank_that_was_not_stopped():
    errors = {1: RankError(1, 10.0, "one"), 0: RankError(0, 11.0, "zero: connection closed by peer")}
    assert first_failure({0: 1, 1: 2}, errors) == (1, 2, "one")
    # The rank that wrote its error was stopped by torchrun (SIGTERM) while it tore down, after a peer crashed
    # (seen on a 2-core machine): the status it wrote is the one to exit with, not 143.
    said = {1: RankError(1, 10.0, "one", status=2), 0: RankError(0, 11.0, "zero", status=1)}
    assert first_failure({0: -int(signal.SIGABRT), 1: -int(signal.SIGTERM)}, said) == (1, 2, "one")
    # No rank wrote an error: a rank that exited on its own (parity's verdict) before one torchrun stopped.
    assert first_failure({0: -int(signal.SIGTERM), 1: 1}, {}) == (1, 1, None)
    assert first_failure({0: 1, 1: 1}, {}) == (0, 1, None)
    assert failure_report(0, 1, None) is None  # the ranks said why (a verdict): nothing added
    rank, status, text = first_failure({0: -int(signal.SIGTERM), 1: -int(signal.SIGKILL)}, {})
    assert (rank, status) == (1, 137)
    assert failure_report(rank, status, text) == (
        "exactrl: rank 1 was killed by SIGKILL (exit status 137); the other ranks were stopped"
    )


STUBBORN = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
SECOND_CTRL_C = """
import subprocess, sys, pathlib
from exactrl.distributed.launch import call_forwarding_signals
folder = pathlib.Path(sys.argv[1])
rank = subprocess.Popen([sys.executable, "-c", sys.argv[2]], start_new_session=True)  # a rank: its own session
(folder / "pid-0").write_text(str(rank.pid))
sys.exit(call_forwarding_signals([sys.executable, "-c", sys.argv[2]], pids=folder))
"""


def test_a_second_ctrl_c_kills_the_agent_and_the_ranks(tmp_path):
    """The first Ctrl-C goes to torchrun's agent (the ranks checkpoint); a second one kills the agent and every rank
    that left its pid, at once: here both ignore SIGINT, as a rank finishing its step does."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen(
        [sys.executable, "-c", SECOND_CTRL_C, str(tmp_path), STUBBORN],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = ""
    while (
        seen.count("up") < 2
    ):  # the agent and the rank are up (each says so once; two writers of one pipe, so
        line = p.stdout.readline()  # their lines may interleave: "upup")
        assert line, seen
        seen += line
    rank = int((tmp_path / "pid-0").read_text())
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert p.poll() is None  # the first Ctrl-C stops nothing at once
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=20) == 128 + signal.SIGINT
    assert "Ctrl-C again: killing the ranks without a checkpoint" in p.stderr.read()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{rank}").exists() and Path(f"/proc/{rank}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the rank survived the second Ctrl-C"
        time.sleep(0.1)


ULP = """
import json
import os
if os.environ.get("RANK") == "2":  # the generator: its first batch's last sequence one ulp off (a trainer's share)
    import torch
    import exactrl.engine.engine as engine_mod

    collect = engine_mod._Generation.collect
    calls = {"n": 0}

    def planted(self, outputs):
        collect(self, outputs)
        calls["n"] += 1
        if calls["n"] == 1:
            lp = [s for o in outputs for s in o.samples][-1].rollout_logprobs
            lp[0] = torch.nextafter(lp[0], torch.tensor(0.0))

    engine_mod._Generation.collect = planted
"""


@pytest.mark.extended  # a 3-rank launch; the fault is caught before the update by default in test_offpolicy_dist
def test_a_disaggregated_guard_abort_at_k0_reads_as_one_verdict_naming_the_rank_and_token(tmp_path):
    """One generator (rank 2) and two trainers, max_off_policy_steps = 0, a one-ulp fault in a sequence a trainer
    other than rank 0 trains on: whichever trainer fails first, the one line names the rank and the first token,
    no traceback (the generator's end-of-run barrier included), and the replay report names the rank."""
    (tmp_path / "sitecustomize.py").write_text(ULP)
    out = tmp_path / "run"
    sets = ["sft.steps=0", "algorithm.rollouts_per_step=8", "algorithm.group_size=2", "task.num_eval=0",
            "task.eval_every=0", "sampling.max_tokens=4", "run.progress=false", "run.tensorboard=false",
            "train.steps=2", "distributed.generator_ranks=1", f"run.output_dir={out}"]  # fmt: skip
    res = _exactrl(
        ["train", "configs/quickstart.toml", *[x for s in sets for x in ("--set", s)], "--nproc", "3"],
        extra_path=tmp_path,
        timeout=400,
    )
    assert res.returncode == 1, res.stderr[-4000:]
    assert "Traceback" not in res.stderr and "Connection closed" not in res.stderr, res.stderr[-4000:]
    verdict = [ln for ln in res.stderr.splitlines() if ln.startswith("exactrl train: ")]
    assert len(verdict) == 1, res.stderr[-4000:]
    assert "; first on rank 1 (ranks with a differing token: 1): rollout " in verdict[0], verdict
    assert ", token id " in verdict[0] and "no optimizer step was applied" in verdict[0]
    (report,) = out.glob("mismatch-*/report.json")
    assert {s["rank"] for s in json.loads(report.read_text())["sequences"]} == {1}
