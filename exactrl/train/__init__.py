"""The trainer side: packed microbatches through the shared model, the optimizer step, checkpoints, the RL loop."""
