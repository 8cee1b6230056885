"""exactrl: RL post-training with bitwise-identical rollout and trainer log-probabilities."""

__version__ = "0.1.0"
