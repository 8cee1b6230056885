"""Seeing a run: metrics.jsonl (one object per step, stable keys), TensorBoard when installed, a live line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume: bool = False):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            self.path.unlink()
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))
            except Exception:  # tensorboard not installed: the JSONL log is the source of truth anyway
                self.tb = None

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint's step (they will be logged again), and the
        after-RL evaluation of the interrupted run (logged after its last checkpoint; the resumed run logs its own)."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("step", -1) <= step and rec.get("phase") != "after_rl":
                keep.append(line)
        self.path.write_text("".join(k + "\n" for k in keep))

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean, sort_keys=True) + "\n")
        if self.tb is not None:
            step = int(record.get("step", 0))
            for k, v in record.items():
                if (
                    isinstance(v, int | float)
                    and not isinstance(v, bool)
                    and k != "step"
                    and math.isfinite(v)
                ):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def step_line(m: dict[str, Any]) -> str:
    """The live line printed per step."""

    def f(key: str, fmt: str = ".3f", default: str = "-") -> str:
        v = m.get(key)
        return default if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

    mism = m.get("mismatch/num_mismatched_tokens")
    mism_s = "-" if mism is None else f"{int(mism)}/{int(m.get('mismatch/num_tokens', 0))}"
    return (
        f"step {m['step']:>4} | reward {f('reward/mean')} | acc {f('train/accuracy', '.2f')} | "
        f"len {f('response_length/mean', '.1f')} | loss {f('loss', '.4f')} | kl {f('kl_ref', '.4f')} | "
        f"ent {f('entropy', '.3f')} | mismatch {mism_s} | {f('perf/tokens_per_s', '.0f')} tok/s | "
        f"{f('perf/step_s', '.1f')} s"
    )
