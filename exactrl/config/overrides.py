"""`--set section.key=value` overrides, each value a TOML literal checked against the field's type."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from exactrl.config.errors import ConfigError
from exactrl.config.fields import _convert, _Ctx, _hints, _init_fields, _is_dataclass_type, _unknown_error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib

_T = TypeVar("_T")


def _parse_literal(text: str) -> Any:
    """A TOML literal (``1e-5``, ``true``, ``[1, 2]``, ``"x"``), or the text itself when it is not one."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    return parsed["v"] if list(parsed) == ["v"] else text


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``"section.key=value"`` into the dotted key and the value parsed as a TOML literal."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"bad override {item!r}: expected section.key=value")
    return key, _parse_literal(raw.strip())


def apply_overrides(cfg: _T, overrides: Iterable[str]) -> _T:
    """Return a copy of ``cfg`` with each ``section.key=value`` override applied and type-checked.

    The value is a TOML literal; when that does not fit the field's type, the raw text is tried as a string
    (so ``run.name=42`` gives ``"42"``) and as a Python number (``.5``). Does not run ``validate()``.
    """
    cfg = copy.deepcopy(cfg)
    root = type(cfg)
    for item in overrides:
        key, value = parse_override(item)
        raw = item.partition("=")[2].strip()
        ctx = _Ctx(root=root, where=f"--set {item}")
        parts = key.split(".")
        obj: Any = cfg
        prefix = ""
        for i, part in enumerate(parts):
            cls = type(obj)
            fields = _init_fields(cls)
            last = i == len(parts) - 1
            if part not in fields:
                raise _unknown_error(cls, prefix, part, not last, ctx)
            tp = _hints(cls)[part]
            if not last:
                if not _is_dataclass_type(tp):
                    raise ConfigError(
                        f"'{prefix}{part}' is not a section (in --set {item})", key=f"{prefix}{part}"
                    )
                obj = getattr(obj, part)
                prefix += part + "."
                continue
            if _is_dataclass_type(tp):
                raise ConfigError(
                    f"'{key}' is a section; set one of its keys, e.g. --set {key}.<key>=value", key=key
                )
            setattr(obj, part, _convert_override(value, raw, tp, key, ctx))
    return cfg


def _convert_override(value: Any, raw: str, tp: Any, key: str, ctx: _Ctx) -> Any:
    candidates: list[Any] = [value]
    if raw != value:
        candidates.append(raw)
    for number in (int, float):
        try:
            candidates.append(number(raw))
            break
        except ValueError:
            pass
    error: ConfigError | None = None
    for candidate in candidates:
        try:
            return _convert(candidate, tp, key, ctx)
        except ConfigError as e:
            error = error or e
    assert error is not None
    raise error


# ----------------------------------------------------------------------------------------------------------
# Loading and saving
# ----------------------------------------------------------------------------------------------------------
