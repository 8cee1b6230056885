import os

import pytest
import torch

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
