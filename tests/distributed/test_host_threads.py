"""A CUDA run caps the host's intra-op threads (its host-side torch ops are bookkeeping on small tensors, and a
fork-join over every core stalled the step 2x on a shared host); a CPU run, and a process whose OMP_NUM_THREADS was
set, keep theirs."""

import torch

from exactrl.distributed.env import HOST_THREADS_CUDA, limit_host_threads


def test_cuda_runs_cap_host_threads_cpu_runs_keep_theirs(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(HOST_THREADS_CUDA + 2)
        assert limit_host_threads("cpu") == HOST_THREADS_CUDA + 2
        assert limit_host_threads("cuda:0") == HOST_THREADS_CUDA
        torch.set_num_threads(1)
        assert limit_host_threads(torch.device("cuda")) == 1  # never raised
        torch.set_num_threads(HOST_THREADS_CUDA + 2)
        monkeypatch.setenv("OMP_NUM_THREADS", str(HOST_THREADS_CUDA + 2))
        assert limit_host_threads("cuda") == HOST_THREADS_CUDA + 2  # the user's (or torchrun's) choice stands
    finally:
        torch.set_num_threads(before)
