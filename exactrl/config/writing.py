"""Writing a config as TOML: every field, `load(dump(cfg)) == cfg`."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _toml_str(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # shortest repr round-trips exactly; inf/nan/1e-05 are valid TOML
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items() if x is not None)
        return "{ " + items + " }" if items else "{}"
    raise TypeError(f"cannot write {type(v).__name__} value {v!r} as TOML")


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _toml_tree(obj: Any) -> Any:
    """Dataclasses -> dicts. None is omitted when it is the default, else written as the string "none"."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            v = getattr(obj, f.name)
            if v is None:
                if _default_of(f) is not None:
                    out[f.name] = "none"
                continue
            out[f.name] = _toml_tree(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [_toml_tree(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _toml_tree(x) for k, x in obj.items()}
    return obj


def _write_table(lines: list[str], table: dict[str, Any], path: list[str]) -> None:
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, dict)]
    tables = [(k, v) for k, v in table.items() if isinstance(v, dict)]
    if path and (scalars or not tables):
        lines.append("")
        lines.append("[" + ".".join(_toml_key(p) for p in path) + "]")
    for k, v in scalars:
        lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
    for k, v in tables:
        _write_table(lines, v, [*path, k])


def dump_toml(cfg: Any) -> str:
    """Serialise a config dataclass to TOML, every field included; ``load(dump(cfg)) == cfg``."""
    tree = _toml_tree(cfg)
    if not isinstance(tree, dict):
        raise TypeError(f"dump_toml expects a dataclass instance, got {type(cfg).__name__}")
    lines: list[str] = []
    _write_table(lines, tree, [])
    return "\n".join(lines).lstrip("\n") + "\n"


def save_config(cfg: Any, path: str | Path) -> None:
    """Write ``dump_toml(cfg)`` to ``path`` atomically, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dump_toml(cfg), encoding="utf-8")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------
# Field documentation
