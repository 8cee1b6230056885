"""Batch-invariant Triton kernels for the exact CUDA backend (`exactrl.ops.triton_ops.TritonOps`).

One module per op family: `matmul` (persistent GEMM, a family of tiles that keep one in-order K reduction),
`norm` (RMSNorm), `elementwise` (SiLU-mul, RoPE), `attention` (one kernel for training, prefill and decode, keys
folded in fixed chunks, plus the combine kernel of split-KV decode), `logprobs`
(row-wise log-softmax with temperature). `common` holds the pieces they share.
"""
