"""What every benchmark script shares at its start: a parser whose --help is the script's docstring, the
refusal of a GPU-only probe on a machine without a GPU (one line, exit 2, instead of a CUDA traceback), and the
host's threads capped on CUDA as every exactrl command caps them (`cap_host_threads`).

The scripts import it from their own folder (a script's folder is first on sys.path)."""

from __future__ import annotations

import argparse

from exactrl.bench_records import busy_cores  # the scripts' spinner is the CLI's (`bench --busy-cores`)

__all__ = ["busy_cores", "cap_host_threads", "kernel_device", "parser", "require_cuda"]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser that prints the script's docstring as its --help."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def cap_host_threads(device: str) -> int:
    """torch's intra-op threads as every exactrl command computing on `device` has them (exactrl.cli's
    cap_host_threads, the rule of exactrl.distributed.env.limit_host_threads: capped on CUDA unless
    OMP_NUM_THREADS is set): a script's figures are then the command's, also on a host with a busy core. Every
    script that computes on a device calls it (or require_cuda / kernel_device, which do) before its work.
    Returns the thread count now."""
    from exactrl.distributed.env import limit_host_threads

    return limit_host_threads(device)


def require_cuda(script: str) -> None:
    """A probe of CUDA kernels, streams or graphs: stop with one line where torch sees no GPU; else cap the host's
    threads (`cap_host_threads`)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU (torch sees none here); --help says what it measures")
    cap_host_threads("cuda")


def kernel_device(script: str) -> str:
    """Where a probe of exactrl's Triton kernels runs: the GPU (host threads capped, `cap_host_threads`), or the
    CPU under Triton's interpreter (TRITON_INTERPRET=1: the dry run at small sizes, bits checked, times
    meaningless); else refuse in one line."""
    import os

    import torch

    if torch.cuda.is_available():
        cap_host_threads("cuda")
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    raise SystemExit(
        f"{script}: needs a CUDA GPU, or TRITON_INTERPRET=1 for a dry run on the CPU with small sizes; --help says "
        "what it measures"
    )
