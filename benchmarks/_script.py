"""What every benchmark script shares at its start: a parser whose --help is the script's docstring, and the
refusal of a GPU-only probe on a machine without a GPU (one line, exit 2, instead of a CUDA traceback).

The scripts import it from their own folder (a script's folder is first on sys.path)."""

from __future__ import annotations

import argparse
import multiprocessing as mp


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser that prints the script's docstring as its --help."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def require_cuda(script: str) -> None:
    """A probe of CUDA kernels, streams or graphs: stop with one line where torch sees no GPU."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU (torch sees none here); --help says what it measures")


def kernel_device(script: str) -> str:
    """Where a probe of exactrl's Triton kernels runs: the GPU, or the CPU under Triton's interpreter
    (TRITON_INTERPRET=1: the dry run at small sizes, bits checked, times meaningless); else refuse in one line."""
    import os

    import torch

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    raise SystemExit(
        f"{script}: needs a CUDA GPU, or TRITON_INTERPRET=1 for a dry run on the CPU with small sizes; --help says "
        "what it measures"
    )


def _spin() -> None:  # pragma: no cover - a busy core beside the run
    while True:
        pass


def busy_cores(n: int) -> list[mp.Process]:
    """Start n processes that each keep a core busy (what `yes > /dev/null` does), as a shared host would; they are
    daemons, so they end with the script."""
    procs = [mp.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    return procs
