"""How fast a model starts: a preset's random weights drawn on the device, and an HF safetensors checkpoint of it
loaded back (`exactrl.model.hf.load_model`, the path `model.path` takes), against the disk's own sequential read
of the same files.

The checkpoint is written to --dir (kept with --keep), synced and its pages dropped from the page cache
(posix_fadvise DONTNEED: no root needed for one's own files), then (1) every file is read whole in 64 MiB chunks:
the disk's read bandwidth for these files; the pages are dropped again; (2) `load_model` reads and places every
tensor on --device. Printed: a table, and one JSON line (`"bench": "load"`) with seconds per billion parameters of
the random init, the read and load GB/s, and load / read. A page cache that does not drop (some file systems ignore
the advice) shows as a read far above the disk's; the record carries `cache_dropped` (the first read's speed is
then the cache's, and says so).

    python benchmarks/load_bandwidth.py --preset qwen3-8b --device cuda --dir /tmp/ckpt
    python benchmarks/load_bandwidth.py --preset tiny --device cpu --dir /tmp/ckpt   # the dry run
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from _script import cap_host_threads, parser

CHUNK = 64 << 20


def _drop(files: list[Path]) -> bool:
    """Ask the kernel to drop the files' cached pages; False where the platform has no fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _read_all(files: list[Path]) -> tuple[int, float]:
    """Bytes read and seconds: each file whole, sequentially, in CHUNK pieces into one reused buffer."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    return total, time.perf_counter() - t0


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dir", required=True, help="where the checkpoint is written (a new folder)")
    ap.add_argument("--keep", action="store_true", help="leave the checkpoint in --dir")
    args = ap.parse_args()
    cap_host_threads(args.device)  # as `exactrl` caps them on CUDA

    import torch

    from exactrl.model.hf import dtype_from_name, load_model, save_model
    from exactrl.model.loading import load_policy

    out = Path(args.dir)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"load_bandwidth.py: --dir {out} is not empty; give a new folder")
    device = args.device

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    model, tok = load_policy(preset_name=args.preset, device=device, dtype=args.dtype, init_draws="keyed")
    sync()
    init_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    save_model(model, out, tok)
    save_s = time.perf_counter() - t0
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    files = sorted(out.glob("*.safetensors"))
    dropped = _drop(files)
    nbytes, read_s = _read_all(files)
    _drop(files)
    t0 = time.perf_counter()
    loaded = load_model(out, device=device, dtype=dtype_from_name(args.dtype))
    sync()
    load_s = time.perf_counter() - t0
    assert sum(p.numel() for p in loaded.parameters()) == params
    rec = {
        "bench": "load",
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": args.dtype,
        "params": params,
        "files": len(files),
        "checkpoint_bytes": nbytes,
        "random_init_s": round(init_s, 3),
        "random_init_s_per_billion": round(init_s / (params / 1e9), 3),
        "save_s": round(save_s, 3),
        "read_s": round(read_s, 3),
        "read_gb_per_s": round(nbytes / read_s / 1e9, 3),
        "load_s": round(load_s, 3),
        "load_gb_per_s": round(nbytes / load_s / 1e9, 3),
        "load_over_read": round(read_s / load_s, 3),
        "cache_dropped": dropped,
    }
    rows = [
        ("random init (keyed), s", rec["random_init_s"]),
        ("  s per billion params", rec["random_init_s_per_billion"]),
        ("checkpoint GB", nbytes / 1e9),
        ("disk read GB/s", rec["read_gb_per_s"]),
        ("load_model GB/s", rec["load_gb_per_s"]),
        ("load / read", rec["load_over_read"]),
    ]
    for k, v in rows:
        print(f"{k:28} {v:.4g}", file=sys.stderr)
    print(json.dumps(rec))
    if not args.keep:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
