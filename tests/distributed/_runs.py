"""What the multi-rank CLI tests share: the reward file they write, a torchrun launch of a driver over a job spec,
a run cut back to an earlier checkpoint as a crash leaves it, and the comparisons of two runs' records and weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]

# The quickstart shrunk for the memory-phase and offload runs: no SFT, 16 rollouts (4 prompts x 4) of 4 tokens, bf16.
SMALL_BF16 = [
    "sft.steps=0",
    "train.warmup_steps=0",
    "train.lr_schedule=constant",
    "algorithm.rollouts_per_step=16",
    "algorithm.group_size=4",
    "task.num_eval=0",
    "task.eval_every=0",
    "sampling.max_tokens=4",
    "run.progress=false",
    "run.tensorboard=false",
    "run.report=false",
    "model.dtype=bfloat16",
    "train.keep_checkpoints=4",
]

REWARD = '''
import hashlib


def hashed(completion, answer, example):
    """Rewards that vary within a group (a random tiny model never solves the arithmetic)."""
    return (int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5) / 4
'''


def launch(
    driver: Path, tmp: Path, nproc: int, jobs: list[dict], tag: str, timeout: float
) -> tuple[int, str, float]:
    """Run `driver` over `jobs` on nproc local ranks (torchrun, gloo, one intra-op thread each): its exit code,
    output and seconds."""
    spec = tmp / f"spec-{tag}.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    t = time.perf_counter()
    p = subprocess.run(
        [*cmd, str(driver), str(spec)], capture_output=True, text=True, env=env, cwd=tmp, timeout=timeout
    )
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - t


# `exactrl <argv>` for each argv of sys.argv[1] (JSON) in turn, in this process: the first non-zero exit ends it.
_PLAIN = """
import json, sys
from exactrl.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    if code:
        sys.exit(code)
"""


def plain(tmp: Path, argvs: list[list[str]], timeout: float = 600) -> tuple[int, str, float]:
    """`exactrl <argv>` for each of `argvs` in turn, without torchrun (the one-device path), in one process (one
    interpreter start, about 3.5 s of imports on a 2-core machine, for all of them), one intra-op thread: the
    first non-zero exit code (else 0), the output and the seconds."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _PLAIN, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=timeout,
    )
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - t


def small_argv(tmp: Path, name: str, steps: int, *extra: str, resume: bool = False) -> list[str]:
    """`exactrl train` arguments of a SMALL_BF16 quickstart run of `steps` steps in tmp/name, rewarded by the
    `hashed` plug-in written to tmp/reward.py (the tests write REWARD there)."""
    sets = [*SMALL_BF16, f"train.steps={steps}", f"run.output_dir={tmp / name}", *extra]
    sets.append(f'reward.functions=["{tmp / "reward.py"}:hashed"]')
    argv = ["train", str(ROOT / "configs" / "quickstart.toml"), *[x for s in sets for x in ("--set", s)]]
    return argv + (["--resume"] if resume else ["--overwrite"])


def crashed_after(src: Path, dst: Path, step: int) -> None:
    """A copy of run `src` as a crash right after step `step`'s checkpoint leaves it."""
    shutil.copytree(src, dst)
    ckpts = dst / "checkpoints"
    for d in ckpts.glob("step-*"):
        if int(d.name.split("-")[1]) > step:
            shutil.rmtree(d)
    (ckpts / "latest").write_text(f"step-{step:06d}\n")
    (dst / "summary.json").unlink()


def _timing(key: str) -> bool:
    """A timing or perf counter (they differ between any two runs), a rank's own (`.../wait_s/rank1`) included."""
    base = re.sub(r"/rank\d+$", "", key)
    # env/time_s_mean: the environment's wall time per episode (multi-turn runs)
    return key.startswith(("perf/", "time/")) or base.endswith("_s") or "time_s" in base or key == "minutes"


def records(run: Path) -> list[dict]:
    """Every logged step's record, timings and perf counters left out (they differ between any two runs)."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.append({k: v for k, v in r.items() if not _timing(k)})
    return out


def weights(run: Path) -> dict[str, torch.Tensor]:
    """The policy weights of the run's latest checkpoint."""
    root = run / "checkpoints"
    return load_file(str(root / (root / "latest").read_text().strip() / "policy" / "model.safetensors"))


def same(a: Path, b: Path) -> bool:
    """Two runs with equal step records (timings aside) and bitwise equal latest weights."""
    wa, wb = weights(a), weights(b)
    return records(a) == records(b) and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def mismatched(run: Path) -> float:
    return sum(r.get("mismatch/num_mismatched_tokens", 0.0) for r in records(run))


# Dynamic sampling on a coin-flip reward in groups of 2: groups without signal are dropped and the trainers ask
# their generator for extra rounds, the same number on every trainer (the decision is global).
COIN = """
import hashlib

def coin(completion, answer, example):
    return float(int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 4 == 0)
"""


def dynamic_argv(tmp: Path, name: str, steps: int, *extra: str) -> dict:
    """A `_driver.py` job: a run of `steps` with DAPO's dynamic sampling on the coin reward (tmp/coin.py: COIN)."""
    argv = small_argv(tmp, name, steps, *extra)
    sets = ["algorithm.dynamic_sampling=reward", "algorithm.group_size=2", "algorithm.rollouts_per_step=8"]
    sets += ["sampling.temperature=1.0", f'reward.functions=["{tmp / "coin.py"}:coin"]']
    return {"kind": "cli", "argv": argv[:-1] + [x for s in sets for x in ("--set", s)] + argv[-1:]}
