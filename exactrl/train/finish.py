"""The end of a run: the held-out accuracy after RL, summary.json, report.png and the summary lines. `RLRun`
(exactrl/train/loop.py) inherits `finish`; it reads the run's totals, summary, clock and rewards."""

from __future__ import annotations

import json
from typing import Any

from exactrl.model.files import writing
from exactrl.train.logging import summary_text
from exactrl.train.run_summary import algorithm_label, summary_totals


class Finish:
    """`RLRun`'s last stage (mixed into it)."""

    cfg: Any
    # What `RLRun.__init__` sets (and its methods these call): declared for the type checker.
    clock: Any
    dist: Any
    evaluate: Any
    exact: Any
    logger: Any
    out: Any
    out_dir: Any
    rewards: Any
    step: Any
    stopped_early: Any
    stopped_in_sft: Any
    summary: Any
    task: Any
    totals: Any

    def finish(self) -> dict[str, Any]:
        """The held-out accuracy after RL, summary.json, report.png and the summary lines."""
        after = self.evaluate() if not self.stopped_in_sft else {}
        self.logger.log({"step": self.step, **after, "phase": "after_rl"})
        self.logger.close()
        t = self.totals
        total_s = self.clock.total_s()
        self.summary.update(
            {
                "accuracy_after_rl": after.get("eval/accuracy"),
                "rl_steps": self.step,
                "minutes": total_s / 60.0,
                # After SFT (and the model's loading before it): RL steps, evaluations, checkpoints.
                "rl_elapsed_s": total_s - self.summary.get("sft_elapsed_s", 0.0),
                "mismatched_tokens_total": t["mismatched"],
                "compared_tokens_total": t["compared"],
                "skipped_prompts_total": t["skipped_prompts"],
                "reward_errors_total": t["reward_errors"],
                "nan_steps_total": t["nan_steps"],
                "mismatch_skipped_steps_total": t.get("mismatch_skipped_steps", 0),
                "exact": self.exact,
                "algorithm": algorithm_label(self.cfg),
                **summary_totals(t),
                "advantage": self.cfg.algorithm.resolved_advantage,
                "policy_loss": self.cfg.algorithm.resolved_policy_loss,
                "stopped_early": self.stopped_early or self.stopped_in_sft,
                "skipped_records_total": getattr(self.task, "num_skipped", 0),
            }
        )
        if not self.summary["stopped_early"]:  # a resumed run that reached its end: the old stop is history
            self.summary.pop("stopped_by", None)
        if self.rewards is not None:
            self.summary["accuracy_function"] = (
                "environment" if self.cfg.env.name else self.rewards.accuracy_fn
            )
            failure = self.rewards.run_failure()
            if failure is not None:
                # Trained on zero rewards, or without the reward that says what is right, with an accuracy that
                # counts nothing: the run must not look like a success (exit status 3).
                self.summary["all_reward_calls_failed"] = self.rewards.all_calls_failed()
                self.summary["accuracy_function_failed"] = self.rewards.accuracy_failure() is not None
                self.summary["reward_failure"] = failure
        self.clock.stamp(self.summary)
        s = self.summary
        if s.get("accuracy_before_rl") is not None and s.get("accuracy_after_rl") is not None:
            s["accuracy_gain"] = s["accuracy_after_rl"] - s["accuracy_before_rl"]
        s["world_size"] = self.dist.world_size
        if self.dist.is_main:
            with writing(self.out_dir / "summary.json", "the run summary"):
                (self.out_dir / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
        if self.dist.is_main and self.cfg.run.report:
            try:
                from exactrl.train.run_report import draw_report

                draw_report(self.out_dir)
            except ImportError as err:  # matplotlib missing: the numbers are in metrics.jsonl anyway
                self.out(f"report.png not drawn ({err})")
        self.out(summary_text(s, self.out_dir))
        self.dist.barrier()
        return s
