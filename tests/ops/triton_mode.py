"""The start of a test module of the Triton kernels that runs everywhere: without CUDA the kernels run in Triton's
interpreter, which TRITON_INTERPRET=1 selects only when set before the kernel modules are first imported. Import
this module before them (importing it sets the variable), then call `triton_device()` before importing them."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernel modules


def triton_device() -> str:
    """ "cuda", or "cpu" for the interpreter. Skips the calling module when triton is missing, or when another
    module imported the kernels on the CPU before the variable was set."""
    pytest.importorskip("triton")
    from exactrl.ops.triton import common

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if (
        device == "cpu" and not common.INTERPRET
    ):  # pragma: no cover - only when another module imported them first
        pytest.skip(
            "the Triton kernels were imported without TRITON_INTERPRET=1; run this file on its own or set the variable",
            allow_module_level=True,
        )
    return device
