"""`exactrl twin CONFIG`: the same config and seed trained in exact mode, in fast mode, and in fast mode with
importance-sampling correction (TIS; MIS too when asked), each in its own folder, then one comparison report.

What it answers: what does the rollout/trainer mismatch cost a run? All variants start RL from the same weights
(the exact run's SFT warm start, when the config has one), so they differ only in how RL computes. The exact run's rollout logprobs equal the
trainer's bitwise; the fast runs use PyTorch's default kernels, whose results depend on the batch, so the engine's
and the trainer's logprobs of the same token differ by rounding, and the trainer sees a policy slightly off the
one that sampled (TIS truncates the ratio of the two to correct for it, MIS masks tokens where it is large).

Outputs in the twin folder: `<variant>/` (a complete run each), `twin.png` (reward, held-out accuracy, mismatch
KL (k3) and max |delta logprob|, grad norm, step time per step), `twin.md` (the table) and `twin.json` (the
numbers of the table and the command's settings). The runs are one after another in this process.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exactrl.config import RunConfig, apply_overrides, load_config
from exactrl.train.logging import accuracy_label, read_metrics

TIS_MODES = ("token-tis", "seq-tis")
MIS_MODES = ("token-mis", "seq-mis", "icepop")


@dataclass
class Variant:
    name: str
    exact: bool
    correction: str | None

    def overrides(self, out_dir: Path) -> list[str]:
        return [
            f"run.output_dir={out_dir / self.name}",
            f"run.exact={'true' if self.exact else 'false'}",
            f"algorithm.rollout_correction={self.correction or 'none'}",
        ]

    def label(self) -> str:
        mode = "exact" if self.exact else "fast"
        return f"{mode} + {self.correction}" if self.correction else mode


def variants(tis: str = "token-tis", mis: str | None = None) -> list[Variant]:
    if tis not in TIS_MODES:
        raise ValueError(f"--tis must be one of {', '.join(TIS_MODES)}, got {tis!r}")
    if mis is not None and mis not in MIS_MODES:
        raise ValueError(f"--mis must be one of {', '.join(MIS_MODES)}, got {mis!r}")
    out = [Variant("exact", True, None), Variant("fast", False, None), Variant("fast-tis", False, tis)]
    if mis:
        out.append(Variant("fast-mis", False, mis))
    return out


def twin_configs(
    config: str | Path | None,
    overrides: list[str],
    *,
    steps: int | None = None,
    out_dir: str | Path | None = None,
    tis: str = "token-tis",
    mis: str | None = None,
) -> tuple[Path, list[tuple[Variant, RunConfig]]]:
    """(the twin folder, each variant's validated config). The folder defaults to `<run.output_dir>-twin`."""
    extra = [f"train.steps={steps}"] if steps is not None else []
    base = load_config(config, [*overrides, *extra])
    root = Path(out_dir) if out_dir else Path(base.run.output_dir.rstrip("/") + "-twin")
    out = []
    for v in variants(tis, mis):
        more = [f"run.name={base.run.name}-{v.name}"]
        if v.name != "exact" and base.sft.steps > 0:
            # One warm start for all: the fast runs start RL from the exact run's SFT checkpoint. SFT in fast mode
            # would take another trajectory (measured: 45.7% vs 42.0% held-out accuracy before RL on the
            # quickstart), and the comparison is about what mismatch does to RL.
            more += ["sft.steps=0", f"sft.checkpoint={root / 'exact' / 'sft'}"]
        cfg = apply_overrides(base, [*v.overrides(root), *more])
        cfg.validate()
        out.append((v, cfg))
    return root, out


def run_twin(
    config: str | Path | None,
    overrides: list[str] | None = None,
    *,
    steps: int | None = None,
    out_dir: str | Path | None = None,
    tis: str = "token-tis",
    mis: str | None = None,
    overwrite: bool = False,
    out=print,
) -> dict[str, Any]:
    """Train every variant (exactrl.train.loop.train, one after another), then write the comparison report.
    Every variant's folder is checked before the first run starts: a folder that holds a run is refused unless
    overwrite. Returns the twin.json summary."""
    from exactrl.train.loop import train
    from exactrl.train.rundir import check_run_dir

    root, runs = twin_configs(config, overrides or [], steps=steps, out_dir=out_dir, tis=tis, mis=mis)
    plans = [check_run_dir(cfg, overwrite=overwrite) for _, cfg in runs]
    for plan in plans:
        for note in plan.notes:
            out(note)
    t0 = time.perf_counter()
    wall: dict[str, float] = {}
    for (v, cfg), plan in zip(runs, plans):
        out(f"== twin: {v.label()} -> {cfg.run.output_dir}")
        plan.commit(cfg)
        # train() switches process-wide numerics for exact mode (deterministic algorithms, TF32 off): each
        # variant starts from the state the command started with, so a fast run does not inherit exact's.
        deterministic = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        t = time.perf_counter()
        try:
            train(cfg, out=out)
        finally:
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        wall[v.name] = time.perf_counter() - t
    summary = write_twin_report(root, [v for v, _ in runs], wall_s=wall)
    summary["total_wall_s"] = time.perf_counter() - t0
    (root / "twin.json").write_text(json.dumps(summary, indent=2) + "\n")
    out(twin_table(summary))
    out(f"twin report: {root / 'twin.png'}, {root / 'twin.md'}, {root / 'twin.json'}")
    return summary


# --------------------------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------------------------


def _values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) is not None and not _nan(r[key])]


def _nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run_stats(run_dir: Path) -> dict[str, Any]:
    """The table's numbers for one run, from its metrics.jsonl and summary.json."""
    rows = read_metrics(run_dir)
    steps = [r for r in rows if "reward/mean" in r]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    before = [r for r in rows if r.get("phase") == "before_rl" and r.get("eval/accuracy") is not None]
    after = [r for r in rows if r.get("phase") == "after_rl" and r.get("eval/accuracy") is not None]
    reward = _values(steps, "reward/mean")
    tail = reward[-max(1, len(reward) // 10) :]  # the last tenth of the run: one step's reward is noisy
    kl = _values(steps, "mismatch/kl_k3")
    diff = _values(steps, "mismatch/logprob_abs_diff_max")
    step_s = _values(steps, "perf/step_s")
    grad = _values(steps, "grad_norm")
    return {
        "steps": len(steps),
        "final_reward": reward[-1] if reward else None,
        "final_reward_last_tenth": _mean(tail),
        "accuracy_before": before[-1]["eval/accuracy"] if before else summary.get("accuracy_before_rl"),
        "accuracy_after": after[-1]["eval/accuracy"] if after else summary.get("accuracy_after_rl"),
        "mismatched_tokens": int(sum(_values(steps, "mismatch/num_mismatched_tokens"))),
        "compared_tokens": int(sum(_values(steps, "mismatch/num_tokens"))),
        "kl_k3_mean": _mean(kl),
        "kl_k3_max": max(kl) if kl else None,
        "logprob_abs_diff_max_mean": _mean(diff),
        "logprob_abs_diff_max_max": max(diff) if diff else None,
        "grad_norm_mean": _mean(grad),
        "step_s_mean": _mean(step_s),
        "minutes": summary.get("minutes"),
        "accuracy": accuracy_label(run_dir),  # what the accuracy counts (the same for every variant)
    }


def write_twin_report(
    root: Path, runs: list[Variant], wall_s: dict[str, float] | None = None
) -> dict[str, Any]:
    """Write twin.png, twin.md and twin.json for the variant folders under root; returns the summary."""
    summary: dict[str, Any] = {"runs": {}}
    for v in runs:
        stats = run_stats(root / v.name)
        stats["label"] = v.label()
        if wall_s and v.name in wall_s:
            stats["wall_s"] = wall_s[v.name]
        summary["runs"][v.name] = stats
    draw_twin(root, runs, root / "twin.png")
    (root / "twin.md").write_text(twin_table(summary) + "\n")
    (root / "twin.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None or _nan(x) else format(x, spec)


def twin_table(summary: dict[str, Any]) -> str:
    """The Markdown table of a twin summary: one row per variant."""
    head = (
        "| run | steps | final reward (last step / last tenth) | held-out accuracy before -> after | "
        "mismatched tokens | KL k3 mean / max | max abs dlogprob mean / max | grad norm mean | step s | minutes |"
    )
    lines = [head, "|" + "---|" * 10]
    for s in summary["runs"].values():
        pct = lambda x: _fmt(None if x is None else 100 * x, ".1f") + ("%" if x is not None else "")  # noqa: E731
        lines.append(
            f"| {s['label']} | {s['steps']} | {_fmt(s['final_reward'], '.3f')} / "
            f"{_fmt(s['final_reward_last_tenth'], '.3f')} | {pct(s['accuracy_before'])} -> "
            f"{pct(s['accuracy_after'])} | {s['mismatched_tokens']} of {s['compared_tokens']} | "
            f"{_fmt(s['kl_k3_mean'], '.2e')} / {_fmt(s['kl_k3_max'], '.2e')} | "
            f"{_fmt(s['logprob_abs_diff_max_mean'], '.2e')} / {_fmt(s['logprob_abs_diff_max_max'], '.2e')} | "
            f"{_fmt(s['grad_norm_mean'], '.3f')} | {_fmt(s['step_s_mean'], '.2f')} | "
            f"{_fmt(s.get('minutes'), '.1f')} |"
        )
    counts = sorted({s["accuracy"] for s in summary["runs"].values() if s.get("accuracy")})
    if counts:
        lines.append(f"\nHeld-out accuracy: {' / '.join(counts)}.")
    return "\n".join(lines)


def draw_twin(root: Path, runs: list[Variant], path: Path) -> Path:
    """Six panels, one line per variant: reward, held-out accuracy, mismatch KL (k3), max |delta logprob|,
    grad norm, step time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward/mean", "reward (train samples)", None),
        ("eval/accuracy", "held-out accuracy (step 0 = before RL)", None),  # the correctness verdict's
        ("mismatch/kl_k3", "trainer vs rollout KL (k3)", 1e-16),
        ("mismatch/logprob_abs_diff_max", "max |trainer - rollout logprob|", 1e-9),
        ("grad_norm", "grad norm", None),
        ("perf/step_s", "step time (s)", None),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, linthresh) in zip(axes.flat, panels):
        for v in runs:
            rows = read_metrics(root / v.name)
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and not _nan(r[key])]
            if key == "eval/accuracy":
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=v.label())
            else:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=v.label(), alpha=0.8)
        if linthresh:  # exact mode sits at 0, fast mode at rounding-error scale: both visible
            ax.set_yscale("symlog", linthresh=linthresh)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
