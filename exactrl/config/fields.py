"""Dict -> dataclasses, every value type-checked against its annotation; and back. Generic over any tree of
config dataclasses."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints, overload

from exactrl.config.errors import ConfigError
from exactrl.config.schema import RunConfig

_T = TypeVar("_T")
_NoneType = type(None)
_NONE_WORDS = frozenset({"none", "null"})


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a config dataclass, read once per class."""
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _init_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    """A readable name for an annotation: ``float | None``, ``list[str]``, ``"a" | "b"``."""
    if tp is _NoneType or tp is None:
        return "None"
    if tp is Any:
        return "any"
    if _is_dataclass_type(tp):
        return "table"
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in get_args(tp))
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, dict, tuple):
        args = get_args(tp)
        inner = ", ".join(_type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]" if args else origin.__name__
    return getattr(tp, "__name__", repr(tp))


def _expected(tp: Any) -> str:
    """How a type is described in an error message."""
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return _type_name(tp)


def _show(value: Any) -> str:
    r = repr(value)
    if len(r) > 80:
        r = r[:77] + "..."
    return f"{r} ({type(value).__name__})"


def _in(where: str | None) -> str:
    return f" in {where}" if where else ""


def _type_error(key: str, expected: str, value: Any, where: str | None, hint: str = "") -> ConfigError:
    return ConfigError(f"{key}: expected {expected}, got {_show(value)}{_in(where)}{hint}", key=key)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field under a dataclass type."""
    out: list[str] = []
    hints = _hints(cls)
    for name in _init_fields(cls):
        key = f"{prefix}{name}"
        if _is_dataclass_type(hints[name]):
            out.extend(_all_keys(hints[name], key + "."))
        else:
            out.append(key)
    return out


def _all_sections(cls: type, prefix: str = "") -> list[str]:
    out: list[str] = []
    hints = _hints(cls)
    for name in _init_fields(cls):
        if _is_dataclass_type(hints[name]):
            out.append(f"{prefix}{name}")
            out.extend(_all_sections(hints[name], f"{prefix}{name}."))
    return out


@dataclass
class _Ctx:
    root: type
    where: str | None


def _unknown_error(cls: type, prefix: str, name: str, is_section: bool, ctx: _Ctx) -> ConfigError:
    """'unknown key 'train.lrr' in x.toml; did you mean 'train.lr'?' with the best suggestion we can find."""
    full = f"{prefix}{name}"
    hints = _hints(cls)
    siblings = list(_init_fields(cls))
    suggestion: str | None = None
    if is_section:
        candidates = [n for n in siblings if _is_dataclass_type(hints[n])]
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
        if close:
            suggestion = f"[{prefix}{close[0]}]"
        else:
            sections = _all_sections(ctx.root)
            close = difflib.get_close_matches(full, sections, n=1, cutoff=0.6)
            if close:
                suggestion = f"[{close[0]}]"
    else:
        # A value cannot be a section: suggest keys only ('lr' at the top is not [lora]). The same key in another
        # section comes first (train.release_memory is engine.release_memory, not the sibling train.check_memory a
        # spelling match would offer), then a sibling spelled alike.
        scalars = [n for n in siblings if not _is_dataclass_type(hints[n])]
        keys = _all_keys(ctx.root)
        same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == name]
        close = difflib.get_close_matches(name, scalars, n=1, cutoff=0.6)
        if same_leaf:
            suggestion = same_leaf[0]
        elif close:
            suggestion = f"{prefix}{close[0]}"
        else:
            leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
            close = difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.75)
            if close:
                suggestion = leaves[close[0]]
    shown = f"[{full}]" if is_section else full
    msg = f"unknown {'section' if is_section else 'key'} '{shown}'{_in(ctx.where)}"
    if suggestion is not None:
        msg += f"; did you mean '{suggestion}'?"
    else:
        valid = ", ".join(siblings)
        msg += f"; valid keys{f' in [{prefix[:-1]}]' if prefix else ''}: {valid}"
    return ConfigError(msg, key=full)


def _build(cls: type[_T], data: Any, prefix: str, ctx: _Ctx) -> _T:
    """Instantiate dataclass ``cls`` from a dict, type-checking every value."""
    if not isinstance(data, dict):
        raise _type_error(prefix[:-1] or "<root>", "table", data, ctx.where)
    fields = _init_fields(cls)
    hints = _hints(cls)
    for name, value in data.items():
        if name not in fields:
            raise _unknown_error(cls, prefix, str(name), isinstance(value, dict), ctx)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{prefix}{name}", ctx)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key '{prefix}{name}'{_in(ctx.where)}", key=f"{prefix}{name}")
    return cls(**kwargs)


def _convert(value: Any, tp: Any, key: str, ctx: _Ctx) -> Any:
    """Check ``value`` against annotation ``tp`` and return it (ints widened to float, lists copied)."""
    if tp is Any:
        return copy.deepcopy(value)
    if _is_dataclass_type(tp):
        if not isinstance(value, dict):
            raise _type_error(key, "table", value, ctx.where)
        return _build(tp, value, key + ".", ctx)
    origin = get_origin(tp)
    if _is_union(tp):
        args = get_args(tp)
        optional = _NoneType in args
        if value is None and optional:
            return None
        if optional and isinstance(value, str) and value.strip().lower() in _NONE_WORDS:
            return None
        arms = [a for a in args if a is not _NoneType]
        first_error: ConfigError | None = None
        for arm in arms:
            try:
                return _convert(value, arm, key, ctx)
            except ConfigError as e:
                first_error = first_error or e
        if len(arms) == 1 and first_error is not None and first_error.key != key:
            raise first_error  # a nested element failed: its message is the precise one
        expected = _expected(arms[0]) if len(arms) == 1 else " | ".join(_type_name(a) for a in arms)
        if optional:
            expected += " or None" if len(arms) == 1 and get_origin(arms[0]) is Literal else " | None"
        raise _type_error(key, expected, value, ctx.where)
    if origin is Literal:
        allowed = get_args(tp)
        for a in allowed:
            if value == a and type(value) is type(a):
                return a
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [a for a in allowed if isinstance(a, str)], n=1)
            if close:
                hint = f"; did you mean {close[0]!r}?"
        raise _type_error(key, _expected(tp), value, ctx.where, hint)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, "bool", value, ctx.where)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(key, "int", value, ctx.where)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _type_error(key, "float", value, ctx.where)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(key, "str", value, ctx.where)
    if tp is list or origin is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, _type_name(tp), value, ctx.where)
        (elem,) = get_args(tp) or (Any,)
        return [_convert(v, elem, f"{key}[{i}]", ctx) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise _type_error(key, _type_name(tp), value, ctx.where)
        _, vt = get_args(tp) or (str, Any)
        return {str(k): _convert(v, vt, f"{key}.{k}", ctx) for k, v in value.items()}
    raise TypeError(f"{key}: unsupported annotation {tp!r} in a config dataclass")


@overload
def config_from_dict(d: dict[str, Any], *, source: str | None = None) -> RunConfig: ...
@overload
def config_from_dict(d: dict[str, Any], cls: type[_T], source: str | None = None) -> _T: ...
def config_from_dict(d: dict[str, Any], cls: type[Any] = RunConfig, source: str | None = None) -> Any:
    """Build ``cls`` from a nested dict (as parsed from TOML); missing keys keep their defaults.

    Unknown keys/sections and wrong types raise :class:`ConfigError`; ``source`` (a file name) is named in
    the message. Does not run ``validate()``.
    """
    return _build(cls, d, "", _Ctx(root=cls, where=source))


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The nested-dict form of a config dataclass (None values kept; lists copied)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"config_to_dict expects a dataclass instance, got {type(cfg).__name__}")
    return conv(cfg)


# ----------------------------------------------------------------------------------------------------------
