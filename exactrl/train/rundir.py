"""A run directory is never damaged by accident.

`exactrl train` into a directory that already holds something refuses unless told which of two things to do:
continue the run in it (`--resume`) or start over (`--overwrite`, which deletes the old run's files first). A
resume compares the config with the run's saved config.toml and refuses changes that would make the continued
run a different experiment (`--allow-config-change` accepts them, and they are listed either way).

Nothing is written before the run's inputs are validated: `check_run_dir` only reads, and `RunDirPlan.commit`
(called once the model, data and rewards have loaded) clears old files and writes config.toml.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from exactrl.config import ConfigError, RunConfig, _toml_value, config_from_dict, config_to_dict, save_config
from exactrl.model.files import writing

# What a run writes into its output_dir: the only names `--overwrite` deletes (never anything else in the dir,
# so pointing output_dir at a folder with other files in it cannot lose them).
RUN_FILES = (
    "config.toml",
    "metrics.jsonl",
    "samples.jsonl",
    "summary.json",
    "report.png",
    "checkpoints",
    "tensorboard",
    "sft",
    "sft.tmp",
    "sft-checkpoints",
    "wandb",
)

# Keys whose change on --resume leaves the run the same experiment. They size, place, pace or display the run;
# in exact mode none of them changes a bit of what is computed (the kernels are batch-invariant, so engine
# sizing and microbatch budgets do not matter; see DESIGN.md). Every other key (algorithm.*, model.*, task.*,
# reward.*, sampling.*, sft.*, the optimizer's train.* keys, run.seed, run.exact, and any key added later) is
# part of the run's meaning: changing it needs --allow-config-change. An allow-list, so that a new key is
# guarded until someone decides it is harmless.
HARMLESS_KEYS = frozenset(
    {
        "run.name",
        "run.output_dir",  # a run directory may be moved or copied and resumed there
        "run.device",
        "run.log_every",
        "run.tensorboard",
        "run.report",
        "run.progress",
        "run.wandb",
        "run.wandb_project",
        "run.wandb_mode",
        "run.log_samples_every",
        "train.steps",  # resuming to train further is what --resume is for
        "train.save_every",
        "sft.save_every",  # resumed SFT ends with the same bits whatever the checkpoint cadence
        "train.save_at_end",
        "train.keep_checkpoints",
        "train.max_nan_steps",
        "train.cuda_graphs",
        "train.max_tokens_per_microbatch",
        # Where the optimizer state waits between steps: the step runs the same kernel on the same values, and a
        # checkpoint holds the same state either way (tests/distributed/test_offload_multirank.py resumes across).
        "train.offload",
        "task.eval_every",
    }
)
HARMLESS_SECTIONS = ("engine.",)  # KV cache sizing, scheduler limits, CUDA graphs

# Schedules whose value at a step depends on train.steps: changing the steps then changes the lr to come.
_DECAYING = ("cosine", "linear")


class RunDirError(ValueError):
    """The output directory cannot be used as asked (the CLI prints it and exits 2)."""


@dataclass
class ConfigChange:
    key: str
    old: Any
    new: Any

    @property
    def harmless(self) -> bool:
        return self.key in HARMLESS_KEYS or self.key.startswith(HARMLESS_SECTIONS)

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


def _show(v: Any) -> str:
    if v is None:
        return "none"
    try:
        return _toml_value(v)
    except TypeError:
        return repr(v)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_saved_config(path: str | Path) -> RunConfig:
    """A run's config.toml, type-checked (not validated: it validated when the run started)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RunDirError(
            f"{path} is not a readable config ({e}); use --overwrite to start the run over"
        ) from e
    try:
        return config_from_dict(data, RunConfig, source=str(path))
    except ConfigError as e:
        raise RunDirError(
            f"{e}; the saved config of this run no longer loads (written by another version?)"
        ) from e


def config_changes(saved: RunConfig, new: RunConfig) -> list[ConfigChange]:
    """Every leaf key whose value differs between two configs, in the order of the config's fields."""
    a, b = _flatten(config_to_dict(saved)), _flatten(config_to_dict(new))
    return [ConfigChange(k, a.get(k), b.get(k)) for k in b if a.get(k) != b.get(k)]


@dataclass
class RunDirPlan:
    """What `check_run_dir` decided; `commit` carries it out once the run's inputs are known to be good."""

    out_dir: Path
    overwrite: bool = False
    to_delete: list[Path] = field(default_factory=list)
    changes: list[ConfigChange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def commit(self, cfg: RunConfig) -> None:
        """Delete the old run's files (--overwrite), create the directory, write config.toml."""
        with writing(self.out_dir, "the run directory (run.output_dir)"):
            for p in self.to_delete:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out_dir / "config.toml")


def check_run_dir(
    cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, allow_config_change: bool = False
) -> RunDirPlan:
    """Decide what a run may do with cfg.run.output_dir, before anything is written. Raises RunDirError.

    - empty or missing dir: a fresh run.
    - non-empty, neither flag: refused, naming the dir and the two ways on.
    - overwrite: the old run's files (RUN_FILES) are deleted at commit; other files are left alone.
    - resume: the config is compared with the saved config.toml; changes outside HARMLESS_KEYS are refused unless
      allow_config_change. Every change is listed in the plan's notes either way.
    """
    out_dir = Path(cfg.run.output_dir)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other: continue the run, or start it over")
    plan = RunDirPlan(out_dir, overwrite=overwrite)
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirError(f"run.output_dir {out_dir} is a file, not a directory")
    entries = sorted(out_dir.iterdir()) if out_dir.is_dir() else []
    if not entries:
        return plan
    if overwrite:
        plan.to_delete = [p for p in entries if p.name in RUN_FILES or p.name.startswith("config.toml")]
        if plan.to_delete:
            names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in plan.to_delete)
            # Deleted at commit, once the run's inputs have loaded: a run refused before that deletes nothing.
            plan.notes.append(
                f"--overwrite: the previous run's {names} in {out_dir} will be deleted once the model, data and "
                "rewards have loaded (a run refused before that deletes nothing)"
            )
        return plan
    if not resume and all(p.name in ("config.toml", "config.toml.tmp") for p in entries):
        # Only a config: a start that stopped before its first output (e.g. bad data). No results to lose.
        plan.to_delete = entries
        return plan
    if not resume:
        shown = ", ".join(p.name + ("/" if p.is_dir() else "") for p in entries[:6])
        more = f" and {len(entries) - 6} more" if len(entries) > 6 else ""
        raise RunDirError(
            f"run.output_dir {out_dir} is not empty ({shown}{more}). Continue that run with --resume, or start it "
            f"over with --overwrite (deletes its {', '.join(RUN_FILES)}); or set another run.output_dir"
        )
    saved_path = out_dir / "config.toml"
    if not saved_path.is_file():
        return plan  # nothing to compare with (a run stopped before it wrote its config): the loop decides
    plan.changes = config_changes(load_saved_config(saved_path), cfg)
    meaning = [c for c in plan.changes if not c.harmless]
    if meaning and not allow_config_change:
        listed = "\n  ".join(str(c) for c in meaning)
        raise RunDirError(
            f"--resume with a config that changes what the run in {out_dir} is (compared with its config.toml):\n"
            f"  {listed}\n"
            "Put those keys back, start a new run in another run.output_dir, or pass --allow-config-change to "
            "continue with the change anyway"
        )
    for c in plan.changes:
        tag = "" if c.harmless else " (allowed by --allow-config-change)"
        plan.notes.append(f"resume: config change {c}{tag}")
        if c.key == "train.steps" and cfg.train.lr_schedule in _DECAYING:
            plan.notes.append(
                f"resume: train.lr_schedule = {cfg.train.lr_schedule!r} decays to 0 at train.steps, so the "
                "learning rate of the remaining steps changes with it"
            )
    return plan


class RunClock:
    """Wall time of a whole run across its invocations (a run stopped and resumed is one run).

    The time of the invocations before a resume is carried in the checkpoint's saved summary
    (`elapsed_s`, stored by `stamp` right before each checkpoint), so the summary's minutes cover SFT, the
    evaluations and every RL step of the run, not only the last invocation's. Work an interrupted invocation did
    after its last checkpoint is done again on resume and counted once, when it is redone.
    """

    KEY = "elapsed_s"  # a name ending in _s: tools that skip timings skip it

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._before = 0.0

    def resume_from(self, saved_summary: dict[str, Any]) -> None:
        self._before = float(saved_summary.get(self.KEY, 0.0))

    def total_s(self) -> float:
        return self._before + (time.perf_counter() - self._t0)

    def stamp(self, summary: dict[str, Any]) -> None:
        """Record the run's elapsed time in `summary` (the dict the checkpoint saves)."""
        summary[self.KEY] = self.total_s()


# The outputs a finished or stopped run names in its summary lines, in this order, when they are there.
SHOWN_OUTPUTS = ("metrics.jsonl", "report.png", "checkpoints", "sft", "sft-checkpoints", "summary.json")


def run_outputs(out_dir: Path) -> str:
    """The run's outputs that exist in out_dir (folders with a trailing slash): a run stopped during SFT has no
    checkpoints/ yet, and the summary line must not send the user looking for it."""
    there = [n + "/" if (out_dir / n).is_dir() else n for n in SHOWN_OUTPUTS if (out_dir / n).exists()]
    return ", ".join(there)


__all__ = [
    "RunClock",
    "HARMLESS_KEYS",
    "RUN_FILES",
    "ConfigChange",
    "RunDirError",
    "RunDirPlan",
    "check_run_dir",
    "config_changes",
    "load_saved_config",
    "run_outputs",
]
