"""`exactrl report RUN_DIR`: reward, accuracy, response length and mismatch curves from metrics.jsonl to a PNG;
for a multi-turn run (env.name set) also the episodes' turns, tool calls, tool errors, environment time and
observation tokens, drawn and summed up in text; a panel for a mixture of experts' router and one for off-policy
staleness and importance weights when the run logged them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exactrl.train.logging import accuracy_label, read_metrics

# The multi-turn metrics the loop logs per step (exactrl.envs.rollout.episode_metrics), with their labels.
EPISODE_METRICS = {
    "env/turns_mean": "turns per episode",
    "env/tool_calls_mean": "tool calls per episode",
    "env/tool_errors_mean": "tool errors per episode",
    "env/time_s": "environment time, summed over the episodes (s)",
    "env/observation_tokens_mean": "observation tokens per episode",
}


# The panels a mode adds when its metrics are in the run (exactrl/train/router.py, exactrl/train/offpolicy.py,
# the decoupled-PPO loss): the title, and each curve's key and label.
MODE_PANELS = {
    "mixture of experts (router)": {
        "moe/load_max_over_mean": "busiest expert's load / mean",
        "moe/router_entropy": "router entropy",
        "moe/aux_loss": "load-balancing loss",
    },
    "off-policy (staleness, importance weights)": {
        "offpolicy/versions_behind/token_mean": "versions behind (token mean)",
        "offpolicy/versions_behind/max": "versions behind (max)",
        "offpolicy/is_weight/mean": "importance weight (mean)",
        "offpolicy/is_weight/capped_frac": "importance weight capped (fraction)",
    },
}


def _series(rows: list[dict], key: str) -> tuple[list[Any], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def is_multi_turn(rows: list[dict]) -> bool:
    """Whether the run logged episodes (a run with env.name set)."""
    return any("env/turns_mean" in r for r in rows)


def episode_summary(rows: list[dict]) -> list[str]:
    """Text lines on a multi-turn run's episodes: each metric's first, last and mean over the RL steps, and the
    environment's failures in total; [] for a single-turn run."""
    steps = [r for r in rows if "env/turns_mean" in r and "reward/mean" in r]
    if not steps:
        return []
    lines = [f"multi-turn episodes ({len(steps)} RL steps): first step -> last step (mean over the steps)"]
    for key, label in EPISODE_METRICS.items():
        vals = [float(r[key]) for r in steps if r.get(key) is not None]
        if vals:
            lines.append(f"  {label:32} {vals[0]:9.3f} -> {vals[-1]:9.3f}   ({sum(vals) / len(vals):.3f})")
    totals = {
        k: sum(float(r.get(k, 0.0)) for r in steps)
        for k in ("env/episodes", "env/tool_calls", "env/tool_errors", "env/errors", "env/timeouts")
    }
    lines.append(
        f"  in total: {totals['env/episodes']:.0f} episodes, {totals['env/tool_calls']:.0f} tool calls "
        f"({totals['env/tool_errors']:.0f} failed), {totals['env/errors']:.0f} environment errors, "
        f"{totals['env/timeouts']:.0f} timeouts"
    )
    evals = [r for r in rows if r.get("eval/env/tool_calls_mean") is not None]
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(
            f"  held-out episodes: tool calls per episode {first['eval/env/tool_calls_mean']:.3f} -> "
            f"{last['eval/env/tool_calls_mean']:.3f}, turns {first['eval/env/turns_mean']:.3f} -> "
            f"{last['eval/env/turns_mean']:.3f}"
        )
    return lines


def report_figure(rows: list[dict], accuracy: str = ""):
    """The report as a matplotlib Figure: 2 x 2 panels, a row for a multi-turn run's episodes, and the modes'
    panels (MODE_PANELS, two a row) when their metrics are present.
    accuracy: what the accuracy counts (`accuracy_label`), shown in the held-out panel's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    multi = is_multi_turn(steps)
    # The modes' own panels, one each when the run logged its metrics: a mixture of experts, off-policy steps.
    extra = [name for name, keys in MODE_PANELS.items() if any(k in r for r in steps for k in keys)]
    n_rows = 2 + (1 if multi else 0) + (len(extra) + 1) // 2
    fig, axes = plt.subplots(n_rows, 2, figsize=(11, 3.5 * n_rows), squeeze=False)

    ax = axes[0, 0]
    ax.plot(*_series(steps, "reward/mean"), label="reward (train)")
    ax.plot(*_series(steps, "train/accuracy"), label="accuracy (train samples)", alpha=0.7)
    ax.set_title("reward")
    ax.set_xlabel("RL step")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(*_series(evals, "eval/accuracy"), "o-", label="held-out accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("held-out accuracy (step 0 = before RL)" + (f"\n{accuracy}" if accuracy else ""))
    ax.set_xlabel("RL step")
    ax = axes[1, 0]
    ax.plot(*_series(steps, "response_length/mean"), label="mean")
    ax.plot(*_series(steps, "response_length/max"), label="max", alpha=0.6)
    ax.set_title("response length (tokens)" + (": model turns + observations" if multi else ""))
    ax.set_xlabel("RL step")
    ax.legend()
    ax = axes[1, 1]
    ax.plot(*_series(steps, "mismatch/num_mismatched_tokens"), "o-", label="mismatched tokens")
    ax.plot(*_series(steps, "mismatch/logprob_abs_diff_max"), label="max |logprob diff|")
    ax.set_title("rollout vs trainer logprobs")
    ax.set_xlabel("RL step")
    ax.legend()
    if multi:
        ax = axes[2, 0]
        for key in ("env/turns_mean", "env/tool_calls_mean", "env/tool_errors_mean"):
            ax.plot(*_series(steps, key), label=EPISODE_METRICS[key])
        ax.set_title("multi-turn episodes")
        ax.set_xlabel("RL step")
        ax.legend()
        ax = axes[2, 1]
        ax.plot(
            *_series(steps, "env/observation_tokens_mean"),
            label=EPISODE_METRICS["env/observation_tokens_mean"],
        )
        ax.set_xlabel("RL step")
        ax.set_ylabel("tokens")
        ax.set_title("environment")
        twin = ax.twinx()  # seconds on their own scale
        twin.plot(*_series(steps, "env/time_s"), color="tab:red", label=EPISODE_METRICS["env/time_s"])
        twin.set_ylabel("seconds")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = twin.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2)
    first = 3 if multi else 2
    for i, name in enumerate(extra):
        ax = axes[first + i // 2, i % 2]
        for key, label in MODE_PANELS[name].items():
            if any(key in r for r in steps):
                ax.plot(*_series(steps, key), label=label)
        ax.set_title(name)
        ax.set_xlabel("RL step")
        ax.legend()
    if len(extra) % 2:
        axes[-1, 1].axis("off")
    fig.tight_layout()
    return fig


def draw_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's report.png (or `out`); returns its path."""
    import matplotlib.pyplot as plt

    fig = report_figure(read_metrics(run_dir), accuracy_label(run_dir))
    path = Path(out) if out else Path(run_dir) / "report.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
