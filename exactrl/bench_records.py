"""What every benchmark record carries (the commit, the source hash, the device, the date) and where its JSON goes;
shared by `bench rollout` / `bench train` (exactrl/bench.py) and `bench rl` (exactrl/bench_rl.py), neither of which
imports the other's module for it."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def source_commit() -> str | None:
    """The commit of the exactrl source tree that ran, with "+dirty" when it has uncommitted changes; None outside
    a git checkout (an installed wheel). A result without its commit cannot be compared with a later one."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "exactrl"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def source_hash() -> str:
    """sha1 (12 hex digits) of the exactrl/ sources that ran: names a result's code even when it ran from an
    uncommitted tree (a copy on a lent GPU machine)."""
    import hashlib

    root = Path(__file__).resolve().parent
    h = hashlib.sha1()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def record_head(bench: str, args, device: str, preset: str | None = None) -> dict:
    """The keys every benchmark record starts with: what ran, on which device and GPU, in which mode and dtype,
    from which commit and when (`benchmarks/bench_check.py` compares a record with the best recorded one)."""
    return {
        "bench": bench,
        "commit": source_commit(),
        "source": source_hash(),
        "date": time.strftime("%Y-%m-%d"),
        "preset": preset or (Path(args.model).name if getattr(args, "model", None) else args.preset),
        "mode": args.mode,
        "device": device,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "dtype": args.dtype,
        "split_kv": getattr(args, "split_kv", "auto"),
    }


def result_path(out_dir: str, bench: str, preset: str, mode: str, device: str) -> Path:
    """Where a benchmark's result JSON goes: <out_dir>/<bench>-<preset>-<mode>-<device or GPU name>.json."""
    dev = torch.cuda.get_device_name().replace(" ", "-") if device.startswith("cuda") else "cpu"
    return Path(out_dir) / f"{bench}-{preset}-{mode}-{dev}.json"
