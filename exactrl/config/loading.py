"""Reading a run's config: TOML file, overrides, validation, and the relative-path rule."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

from exactrl.config.errors import ConfigError, _fail
from exactrl.config.fields import config_from_dict
from exactrl.config.overrides import apply_overrides
from exactrl.config.schema import RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib

_T = TypeVar("_T")


@overload
def load_config(
    path: str | Path | None, overrides: Sequence[str] = (), *, validate: bool = True
) -> RunConfig: ...
@overload
def load_config(
    path: str | Path | None, overrides: Sequence[str], cls: type[_T], *, validate: bool = True
) -> _T: ...
@overload
def load_config(
    path: str | Path | None, overrides: Sequence[str] = (), *, cls: type[_T], validate: bool = True
) -> _T: ...
def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    cls: type[Any] = RunConfig,
    *,
    validate: bool = True,
) -> Any:
    """Read a TOML config (``None`` = all defaults), apply ``section.key=value`` overrides, validate.

    Raises :class:`ConfigError` for invalid TOML, unknown keys, wrong types and failed checks. validate=False: the
    caller validates it next (`exactrl train` in `exactrl.train.resolved.resolve_run`, its one validation).
    """
    if path is None:
        data: dict[str, Any] = {}
        source = None
    else:
        source = str(path)
        text = Path(path).read_text(encoding="utf-8")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"invalid TOML in {source}: {e}") from e
    cfg = config_from_dict(data, cls, source=source)
    cfg = apply_overrides(cfg, overrides)
    check = getattr(cfg, "validate", None)
    if validate and callable(check):
        check()
    if path is not None and isinstance(cfg, RunConfig):
        check_path_anchors(cfg, Path(path).resolve().parent)
    return cfg


# Relative paths: one rule. Every relative path of a run (run.output_dir, data, models, checkpoints, reward files,
# environment and reward modules), written in the config file, given with --set or with a flag, is resolved from
# the working directory, never from the config file's folder. That is what run.output_dir and the recipes'
# data and model paths always did, and what keeps a run's saved config.toml (in its output_dir, far from the
# original config) meaning the same files.
_PATH_KEYS = (
    "model.path",
    "model.tokenizer",
    "task.path",
    "task.eval_path",
    "sft.checkpoint",
    "lora.path",
    "reward.model",
)


def relative_path_refs(cfg: RunConfig) -> list[tuple[str, str, str]]:
    """Every relative file or module a config names: (key, what is written, the path or module looked up)."""
    refs: list[tuple[str, str, str]] = []
    for key in _PATH_KEYS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section, None), name, None)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            refs.append((key, value, value))
    specs = [("reward.functions", f) for f in cfg.reward.functions if isinstance(f, str)]
    if cfg.env.name:
        specs.append(("env.name", cfg.env.name))
    for key, spec in specs:
        target, sep, _ = spec.rpartition(":")
        if not sep or not target:
            continue  # a built-in name
        if target.endswith(".py"):
            if not Path(target).expanduser().is_absolute():
                refs.append((key, spec, target))
        else:  # "package.module:attr": its top package is a file or folder on the import path
            refs.append((key, spec, "module:" + target.split(".")[0]))
    return refs


def _found_in(folder: Path, target: str) -> bool:
    if target.startswith("module:"):
        top = target[len("module:") :]
        return (folder / f"{top}.py").is_file() or (folder / top).is_dir()
    return (folder / Path(target).expanduser()).exists()


def check_path_anchors(cfg: RunConfig, config_dir: Path, cwd: Path | None = None) -> None:
    """Refuse a relative path that is missing from the working directory but present next to the config file:
    the one mistake the working-directory rule invites. Raises ConfigError naming the key, both places and the
    path to write instead. A path found in neither place is left to whatever loads it (that names the file)."""
    import importlib.util

    cwd = (cwd or Path.cwd()).resolve()
    if config_dir.resolve() == cwd:
        return
    for key, written, target in relative_path_refs(cfg):
        if _found_in(cwd, target) or not _found_in(config_dir, target):
            continue
        if target.startswith("module:"):
            module = target[len("module:") :]
            if importlib.util.find_spec(module) is not None:
                continue  # importable as installed: the file next to the config is not what it names
            fix = f"move it into the working directory, or run exactrl from {config_dir}"
            what = f"module {module!r}"
        else:
            rel = os.path.relpath(config_dir / target, cwd)
            fix = f"write {written.replace(target, rel, 1)!r}"
            what = repr(target)
        _fail(
            key,
            f"= {written!r}: {what} is not in the working directory {cwd} but is next to the config file, in "
            f"{config_dir}. Relative paths are resolved from the working directory: {fix}",
        )
