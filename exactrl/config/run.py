"""The `[run]` section: identity, output location, seeding, logging."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from exactrl.config.errors import _check_at_least, _fail

_DEVICE_RE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


@dataclass
class RunSection:
    """Run identity, output location, seeding and logging."""

    name: str = "run"
    """Human-readable run name, used in logs and the TensorBoard run label."""
    output_dir: str = "runs/run"
    """Directory for checkpoints, metrics, the saved config and TensorBoard events."""
    seed: int = 0
    """Seed for all random number generators (data order, sampling, model init)."""
    device: str = "auto"
    """Torch device: "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:N" or "mps"."""
    exact: bool = True
    """Use batch-invariant kernels so rollout logprobs are bitwise equal to the trainer's; false = fast kernels."""
    on_mismatch: Literal["abort", "skip_step", "warn"] = "abort"
    """Exact mode: every rollout logprob is compared with the trainer's before an optimizer step uses it. On a
    difference: "abort" stops the run with no update applied (the last checkpoint stays the resume point) and
    writes output_dir/mismatch-STEP/ for `exactrl parity --replay`; "skip_step" drops the step's batch and goes
    on; "warn" trains on it and logs."""
    log_every: int = 1
    """Log metrics every this many optimizer steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to output_dir."""
    report: bool = True
    """Draw output_dir/report.png (the run's curves) when the run ends; `exactrl report RUN_DIR` draws it later."""
    progress: bool = True
    """Show progress bars when the output is a terminal; otherwise (a log file, CI) a plain line every
    run.log_every steps is printed instead."""
    wandb: bool = False
    """Also log metrics to Weights & Biases (the `wandb` package must be installed; it is not a dependency)."""
    wandb_project: str = "exactrl"
    """Weights & Biases project name."""
    wandb_mode: Literal["online", "offline"] | None = None
    """Weights & Biases mode: "offline" writes to output_dir/wandb with no network (sync later with `wandb sync`);
    unset: the WANDB_MODE environment variable, else online."""
    log_samples_every: int = 0
    """Every this many RL steps, write a few prompts, completions and rewards to samples.jsonl (and TensorBoard
    text); 0 = never."""
    log_samples_count: int = 4
    """How many completions log_samples_every writes per time."""

    def validate(self) -> None:
        if not self.name.strip():
            _fail("run.name", "must not be empty")
        if not self.output_dir.strip():
            _fail("run.output_dir", "must not be empty")
        _check_at_least(self.seed, 0, "run.seed")
        if not _DEVICE_RE.fullmatch(self.device):
            _fail("run.device", f"must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got {self.device!r}")
        _check_at_least(self.log_every, 1, "run.log_every")
        if self.wandb and not self.wandb_project.strip():
            _fail("run.wandb_project", "must not be empty when run.wandb = true")
        _check_at_least(self.log_samples_every, 0, "run.log_samples_every")
        _check_at_least(self.log_samples_count, 1, "run.log_samples_count")
