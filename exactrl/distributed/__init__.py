"""Scale-out under torchrun: the process group, FSDP2 applied from outside the model, sharded checkpoints."""

from exactrl.distributed.env import DistContext, init_from_env, shutdown, under_torchrun
from exactrl.distributed.parallelize import Parallelism, apply_activation_checkpointing

__all__ = [
    "DistContext",
    "Parallelism",
    "apply_activation_checkpointing",
    "init_from_env",
    "shutdown",
    "under_torchrun",
]
