import os

# Set before torch loads OpenMP (it reads the variable once): a waiting intra-op thread sleeps instead of spinning.
# Under `make test` the other pytest-xdist worker keeps one of 2 cores busy, and a test that runs 2 threads (the
# thread-split sweeps) spun against it: tests/model/test_preset_parity.py took 152 s beside one busy core, 19 s
# with this (2-core CPU machine, 2026-11-29, c6ac35d). How a thread waits changes no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter, so CI covers their logic. The variable must be
# set before triton is first imported, which happens in test modules, after this file.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every worker is a process of its own: one thread each keeps 2 workers on 2 cores from
# oversubscribing. Exactness must hold at any thread count; the sweeps run under both settings.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
