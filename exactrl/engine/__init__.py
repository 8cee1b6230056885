"""The rollout engine: continuous batching over a paged KV cache (sequence.py, block_manager.py,
scheduler.py), the model runner (runner.py) and reproducible batch-invariant sampling (sampler.py)."""
