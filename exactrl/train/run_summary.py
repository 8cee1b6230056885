"""What a run's summary says about its algorithm: the name as configured (a preset plus the parts switched on beside
it, e.g. DAPO's) and the running totals of the step metrics that have them (dynamic sampling's prompts and groups).
"""

from __future__ import annotations

from typing import Any

# dynamic_sampling/<key> of each step, summed over the run into the summary's dynamic_sampling_<key>_total.
DYNAMIC_TOTALS = (
    "prompts_drawn",
    "extra_rounds",
    "groups_dropped",
    "groups_kept",
    "groups_padded",
    "groups_missing",
)


def algorithm_label(cfg: Any) -> str:
    """algorithm.name, with what the run adds to the preset named after it: `grpo` for the preset alone, `grpo +
    clip-higher (0.28), dynamic sampling (accuracy), overlong penalty (2 tokens)` for configs/quickstart-dapo.toml."""
    a = cfg.algorithm
    parts = []
    # DAPO's clip-higher raises PPO-clip's upper bound; GSPO's own (sequence-level) range is the preset's.
    if a.eps_high > a.eps_low and a.resolved_policy_loss == "ppo_clip":
        parts.append(f"clip-higher ({a.eps_high:g})")
    if a.dynamic_sampling != "off":
        parts.append(f"dynamic sampling ({a.dynamic_sampling})")
    if cfg.reward.overlong_buffer_tokens:
        parts.append(f"overlong penalty ({cfg.reward.overlong_buffer_tokens} tokens)")
    if a.overlong_filter:
        parts.append("overlong filter")
    return a.name + (" + " + ", ".join(parts) if parts else "")


def add_step_totals(totals: dict[str, Any], m: dict[str, float]) -> None:
    """Add a step's dynamic_sampling/* counts to the run's totals (saved with every checkpoint, so a resumed run's
    totals are the whole run's)."""
    for key in DYNAMIC_TOTALS:
        if f"dynamic_sampling/{key}" in m:
            name = f"dynamic_sampling_{key}"
            totals[name] = totals.get(name, 0) + int(m[f"dynamic_sampling/{key}"])


def summary_totals(totals: dict[str, Any]) -> dict[str, int]:
    """The summary's dynamic_sampling_<key>_total entries (none for a run without dynamic sampling)."""
    return {f"{k}_total": int(v) for k, v in totals.items() if k.startswith("dynamic_sampling_")}
