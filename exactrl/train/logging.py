"""Seeing a run: metrics.jsonl (one object per step, stable keys), samples.jsonl, TensorBoard when installed,
Weights & Biases when asked for, a live line; progress bars only on a terminal."""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from exactrl.model.files import writing
from exactrl.train.rundir import run_outputs


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def is_tty(stream: IO[str] | None = None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


class _NoBar:
    """What progress_bar gives where no bar is drawn: the calls of a tqdm bar, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool = True, stream: IO[str] | None = None) -> Any:
    """A tqdm bar on `stream` (stderr) when enabled and `stream` is a terminal, else a no-op with the same calls.

    Why: tqdm writes carriage-return redraws; in a log file they pile up into one enormous line. Off a terminal
    the step line (`step_line`, every run.log_every steps) is the progress report.
    """
    stream = sys.stderr if stream is None else stream
    if not (enabled and is_tty(stream)):
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, file=stream)


def wandb_mode(configured: str | None) -> str:
    """ "offline" or "online": the config's run.wandb_mode, else WANDB_MODE, else online."""
    mode = configured or os.environ.get("WANDB_MODE") or "online"
    if mode not in ("online", "offline"):
        raise ValueError(f"WANDB_MODE={mode!r}: exactrl supports 'online' or 'offline'")
    return mode


def import_wandb() -> Any:
    """The wandb module, or a ValueError that says how to get it (it is not one of exactrl's dependencies)."""
    try:
        import wandb
    except ImportError as err:
        raise ValueError(
            "run.wandb = true, but the wandb package is not installed: `pip install wandb`, or set "
            "run.wandb = false (metrics.jsonl and TensorBoard log everything without it)"
        ) from err
    return wandb


class MetricsLogger:
    def __init__(
        self,
        out_dir: str | Path,
        tensorboard: bool = True,
        resume: bool = False,
        *,
        wandb: bool = False,
        wandb_project: str = "exactrl",
        wandb_mode: str | None = None,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        warn: Callable[[str], None] = _warn,
    ):
        out_dir = Path(out_dir)
        self.path = out_dir / "metrics.jsonl"
        self.samples_path = out_dir / "samples.jsonl"
        with writing(self.path, "metrics"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not resume:
                for p in (self.path, self.samples_path):
                    p.unlink(missing_ok=True)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warn(
                    "run.tensorboard = true but TensorBoard is not installed (`pip install tensorboard`): no "
                    "event files are written; metrics.jsonl has every metric. Set run.tensorboard = false to "
                    "silence this."
                )
            else:
                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        self.wandb_run = None
        if wandb:
            self.wandb_run = _start_wandb(out_dir, wandb_project, wandb_mode, run_name, config, resume)

    @classmethod
    def from_config(cls, cfg: Any, resume: bool = False, **kwargs: Any) -> MetricsLogger:
        """The logger a RunConfig asks for (run.tensorboard, run.wandb*)."""
        from exactrl.config import config_to_dict

        r = cfg.run
        return cls(
            r.output_dir,
            tensorboard=r.tensorboard,
            resume=resume,
            wandb=r.wandb,
            wandb_project=r.wandb_project,
            wandb_mode=r.wandb_mode,
            run_name=r.name,
            config=config_to_dict(cfg),
            **kwargs,
        )

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint's step (they will be logged again), and the
        after-RL evaluation of the interrupted run (logged after its last checkpoint; the resumed run logs its own).
        samples.jsonl likewise."""
        for path in (self.path, self.samples_path):
            if not path.exists():
                continue
            keep = []
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("step", -1) <= step and rec.get("phase") != "after_rl":
                    keep.append(line)
            with writing(path, "metrics"):
                path.write_text("".join(k + "\n" for k in keep))

    def log_samples(
        self,
        step: int,
        prompts: Sequence[str],
        completions: Sequence[str],
        rewards: Sequence[float],
        answers: Sequence[str] | None = None,
    ) -> None:
        """Write (prompt, completion, reward) rows of one step to samples.jsonl, TensorBoard text and W&B."""
        rows = []
        for i, (p, c, r) in enumerate(zip(prompts, completions, rewards, strict=True)):
            rec: dict[str, Any] = {"step": int(step), "prompt": p, "completion": c, "reward": float(r)}
            if answers is not None:
                rec["answer"] = answers[i]
            rows.append(rec)
        with writing(self.samples_path, "samples"), open(self.samples_path, "a") as f:
            for rec in rows:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        if self.tb is not None:
            # TensorBoard renders text as Markdown: one table per step, cells escaped.
            def cell(x: Any) -> str:
                return str(x).replace("|", "\\|").replace("\n", "\u23ce")

            table = ["| reward | prompt | completion |", "| --- | --- | --- |"]
            table += [f"| {r['reward']:.3f} | {cell(r['prompt'])} | {cell(r['completion'])} |" for r in rows]
            self.tb.add_text("samples", "\n".join(table), int(step))
            self.tb.flush()
        if self.wandb_run is not None:
            import wandb

            cols = ["step", "prompt", "completion", "reward"]
            table = wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])
            self.wandb_run.log({"samples": table}, step=int(step))

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with writing(self.path, "metrics"), open(self.path, "a") as f:  # a full disk names the file
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
        if self.wandb_run is not None:
            nums = {
                k: v
                for k, v in clean.items()
                if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
            }
            # W&B steps must never go back; records logged at the same step (SFT at step 0, evaluations next to
            # their RL step) are merged into that step's row.
            self.wandb_run.log(nums, step=int(record.get("step", 0)))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _start_wandb(
    out_dir: Path,
    project: str,
    mode: str | None,
    name: str | None,
    config: dict[str, Any] | None,
    resume: bool,
) -> Any:
    wandb = import_wandb()
    wdir = out_dir / "wandb"
    wdir.mkdir(parents=True, exist_ok=True)
    # One W&B run per exactrl run: its id is kept in the run directory so that --resume continues it.
    id_file = wdir / "exactrl_run_id"
    if resume and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
    return wandb.init(
        project=project,
        name=name,
        id=run_id,
        resume="allow",
        dir=str(out_dir),
        mode=wandb_mode(mode),
        config=config,
    )


def step_line(m: dict[str, Any]) -> str:
    """The live line printed per step; the modes' own figures (mixture of experts, off-policy) are appended,
    compactly, only when the step logged them."""

    def f(key: str, fmt: str = ".3f", default: str = "-") -> str:
        v = m.get(key)
        return default if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

    mism = m.get("mismatch/num_mismatched_tokens")
    mism_s = "-" if mism is None else f"{int(mism)}/{int(m.get('mismatch/num_tokens', 0))}"
    tps = "tok/s"
    if "mismatch/batch_tokens" in m:
        # Partial rollouts: the guard checks what this step's generation sampled (the batch's new tokens and the
        # carried samples'); the trained batch's tokens were each checked by the generation that sampled them.
        mism_s += (
            f" sampled, batch {int(m['mismatch/batch_tokens'])} checked "
            f"({int(m.get('mismatch/batch_tokens_checked_earlier', 0))} earlier)"
        )
        tps = "tok/s sampled"
    # Failed reward calls (errors, timeouts) show next to the reward they lowered; acc is the correctness verdict
    # (train/accuracy, "-" when the run has no correctness function).
    failed = m.get("reward/errors") or 0
    failed_s = f" ({int(failed)} failed)" if failed else ""
    extra = ""
    if "moe/load_max_over_mean" in m:  # a mixture of experts: the busiest expert's load over the mean
        extra += f" | moe load {f('moe/load_max_over_mean', '.2f')}x"
        if "moe/aux_loss" in m:
            extra += f" aux {f('moe/aux_loss', '.4f')}"
    if (
        "dynamic_sampling/groups_kept" in m
    ):  # DAPO's dynamic sampling: groups with signal kept, dropped, rounds
        extra += (
            f" | groups kept {int(m['dynamic_sampling/groups_kept'])} "
            f"dropped {int(m.get('dynamic_sampling/groups_dropped', 0))} "
            f"(+{int(m.get('dynamic_sampling/extra_rounds', 0))} rounds)"
        )
        if m.get("dynamic_sampling/groups_missing"):
            extra += f" {int(m['dynamic_sampling/groups_missing'])} missing"
    if "offpolicy/versions_behind/token_mean" in m:  # off-policy: staleness and the importance weights
        extra += (
            f" | behind {f('offpolicy/versions_behind/token_mean', '.2f')} "
            f"(max {f('offpolicy/versions_behind/max', '.0f')})"
        )
        if "offpolicy/is_weight/mean" in m:
            extra += (
                f" is-w {f('offpolicy/is_weight/mean', '.3f')} "
                f"({f('offpolicy/is_weight/capped_frac', '.1%')} capped)"
            )
    return (
        f"step {m['step']:>4} | reward {f('reward/mean')}{failed_s} | acc {f('train/accuracy', '.2f')} | "
        f"len {f('response_length/mean', '.1f')} | loss {f('loss', '.4f')} | kl {f('kl_ref', '.4f')} | "
        f"ent {f('entropy', '.3f')} | mismatch {mism_s} | {f('perf/tokens_per_s', '.0f')} {tps} | "
        f"{f('perf/step_s', '.1f')} s{extra}"
    )


class NoLogger:
    """The logger of ranks other than 0: they compute the same global metrics and write nothing."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def log_samples(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def summary_text(s: dict[str, Any], out_dir: Path) -> str:
    def pct(x):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"

    return (
        f"\n== {s['algorithm']} ({'exact' if s['exact'] else 'fast'} mode): {s['rl_steps']} RL steps in "
        f"{s['rl_elapsed_s'] / 60 if 'rl_elapsed_s' in s else s['minutes']:.1f} min"
        + (f" after {s['sft_elapsed_s'] / 60:.1f} min of SFT" if "sft_elapsed_s" in s else "")
        + "\n"
        f"   held-out accuracy {pct(s.get('accuracy_before_rl'))} -> {pct(s.get('accuracy_after_rl'))}"
        f"{_accuracy_source(s)}\n"
        f"   rollout vs trainer logprobs: {s['mismatched_tokens_total']} of {s['compared_tokens_total']} tokens differ\n"
        f"   outputs in {out_dir}/ ({run_outputs(out_dir)})"
        + (
            f"\n   !! {s['reward_failure']}. "
            + (
                "The policy was trained on zero rewards"
                if s.get("all_reward_calls_failed")
                else "The policy never got its correctness reward and accuracy counts nothing"
            )
            + ": exit status 3"
            if s.get("reward_failure")
            else ""
        )
    )


def _accuracy_source(s: dict[str, Any]) -> str:
    """What the accuracy counts, for the summary line (reward.accuracy)."""
    fn = s.get("accuracy_function")
    if "accuracy_function" not in s:  # a summary from before accuracy_function was recorded
        return ""
    if fn is None:
        return " (no correctness function: see reward.accuracy)"
    if fn == "environment":
        return " (episode reward > 0.5)"
    return f" ({fn} > 0.5)"


# Reading a run's files back (`exactrl report`, the guard's twin runs).


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, one dict per logged step."""
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


def accuracy_label(run_dir: str | Path) -> str:
    """What the run's accuracy counts, from its summary.json (`accuracy_function`), for the plot titles: "" when
    the summary does not say (a run still going, or one from before the field)."""
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    if "accuracy_function" not in summary:
        return ""
    fn = summary["accuracy_function"]
    if fn is None:
        return "not reported: no correctness function (reward.accuracy)"
    return "episode reward > 0.5" if fn == "environment" else f"{fn} > 0.5"
