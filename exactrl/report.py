"""`exactrl report RUN_DIR`: reward, accuracy, response length and mismatch curves from metrics.jsonl to a PNG."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e})") from e
    return rows


def draw_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))

    def series(key, src=steps):
        pts = [(r["step"], r[key]) for r in src if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    ax = axes[0, 0]
    ax.plot(*series("reward/mean"), label="reward (train)")
    ax.plot(*series("train/accuracy"), label="accuracy (train samples)", alpha=0.7)
    ax.set_title("reward")
    ax.set_xlabel("RL step")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(*series("eval/accuracy", evals), "o-", label="held-out accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("held-out accuracy (step 0 = before RL)")
    ax.set_xlabel("RL step")
    ax = axes[1, 0]
    ax.plot(*series("response_length/mean"), label="mean")
    ax.plot(*series("response_length/max"), label="max", alpha=0.6)
    ax.set_title("response length (tokens)")
    ax.set_xlabel("RL step")
    ax.legend()
    ax = axes[1, 1]
    ax.plot(*series("mismatch/num_mismatched_tokens"), "o-", label="mismatched tokens")
    ax.plot(*series("mismatch/logprob_abs_diff_max"), label="max |logprob diff|")
    ax.set_title("rollout vs trainer logprobs")
    ax.set_xlabel("RL step")
    ax.legend()
    fig.tight_layout()
    path = Path(out) if out else Path(run_dir) / "report.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
