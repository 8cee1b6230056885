"""Batch-invariant Triton kernels for the exact CUDA backend (`exactrl.ops.triton_ops.TritonOps`).

One module per op family: `matmul` (persistent GEMM, one tile config per dtype), `norm` (RMSNorm),
`elementwise` (SiLU-mul, RoPE), `attention` (one kernel for training, prefill and decode), `logprobs`
(row-wise log-softmax with temperature). `common` holds the pieces they share.
"""
