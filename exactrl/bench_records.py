"""What every benchmark record carries (the commit, the source hash, the device, the date), where its JSON goes and
the `--baseline` record it compares with; shared by `bench rollout` / `bench train` (exactrl/bench.py) and `bench rl` (exactrl/bench_rl.py), neither of which
imports the other's module for it."""

from __future__ import annotations

import json
import multiprocessing as mp
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
        "precision": getattr(args, "precision", "dtype"),
        "busy_cores": getattr(args, "busy_cores", 0),
        "split_kv": getattr(args, "split_kv", "auto"),
    }


def result_path(out_dir: str, bench: str, preset: str, mode: str, device: str) -> Path:
    """Where a benchmark's result JSON goes: <out_dir>/<bench>-<preset>-<mode>-<device or GPU name>.json."""
    dev = torch.cuda.get_device_name().replace(" ", "-") if device.startswith("cuda") else "cpu"
    return Path(out_dir) / f"{bench}-{preset}-{mode}-{dev}.json"


def read_baseline(path: str, bench: str, expect: dict) -> dict:
    """The JSON record of the same benchmark at another world size (`--baseline`), refused with the key that
    differs if it measured something else."""
    p = Path(path)
    try:
        rec = json.loads(p.read_text().strip().splitlines()[-1])
    except FileNotFoundError:
        raise FileNotFoundError(f"--baseline {path}: no such file") from None
    except (json.JSONDecodeError, IndexError) as e:
        raise ValueError(f"--baseline {path}: not a benchmark JSON record ({e})") from None
    if not isinstance(rec, dict) or rec.get("bench") != bench:
        got = rec.get("bench") if isinstance(rec, dict) else type(rec).__name__
        raise ValueError(
            f"--baseline {path}: a {got!r} record; this benchmark compares with {bench!r} records"
        )
    for key in ("world_size", "aggregate_tokens_per_s"):
        if key not in rec:
            raise ValueError(f"--baseline {path}: no {key!r} (written before multi-rank benchmarks existed)")
    for key, value in expect.items():
        if rec.get(key) != value:
            raise ValueError(
                f"--baseline {path}: {key} = {rec.get(key)!r}, this run has {value!r}; compare like with like"
            )
    return rec


def baseline_of(args) -> dict | None:
    """The `--baseline` record this benchmark compares with (None without one), refused by the key that differs
    when it measured something else: read on each rank, and by the `--nproc N` launcher before torchrun starts
    them (exactrl.commands._bench_before_launch)."""
    path = getattr(args, "baseline", None)
    if not path:
        return None
    if args.what == "rollout":
        keys = ("preset", "mode", "dtype", "concurrency", "prompt_len", "max_tokens")
        return read_baseline(path, "rollout", {k: getattr(args, k) for k in keys})
    if args.what == "train":
        if not getattr(args, "fsdp", False):
            raise ValueError("bench train --baseline compares world sizes of the FSDP2 step: add --fsdp")
        expect = {k: getattr(args, k) for k in ("preset", "mode", "dtype")}
        return read_baseline(path, "train-fsdp", {**expect, "tokens_per_rank": args.tokens_per_microbatch})
    try:  # rl: another layout or world size of the same workload
        rec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--baseline {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--baseline {path}: not a `bench rl` result ({e})") from None
    if not isinstance(rec, dict) or rec.get("bench") != "rl":
        raise ValueError(f"--baseline {path}: not a `bench rl` result")
    return rec


def _spin() -> None:  # pragma: no cover - a busy core beside the run
    while True:
        pass


def busy_cores(n: int) -> list[mp.Process]:
    """Start n processes that each keep a host core busy (what `yes > /dev/null` does), as a shared host would:
    `bench --busy-cores N` measures what a user on such a host gets. Daemons: they end with the command."""
    procs = [mp.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    return procs
