"""The environments a run can name: the built-ins by name, or "module:ClassName", and the factory that builds one
per episode. Apart from `base.py` (the classes an environment subclasses), so that the built-ins, which import the
base, are not imported back by it."""

from __future__ import annotations

import functools
import importlib

from exactrl.envs.base import AsyncEnvironment, EnvFactory, Environment


def builtin_envs() -> dict[str, type]:
    """The built-in environments by name."""
    from exactrl.envs.calculator import CalculatorEnv
    from exactrl.envs.guess import GuessNumberEnv

    return {"calculator": CalculatorEnv, "guess": GuessNumberEnv}


def resolve_env(name: str, search_dirs: list[str] | None = None) -> type:
    """An environment class: a built-in name, or "package.module:ClassName" (imported, never a pickle). The
    module is looked up in `search_dirs` (none from the CLI), then the current directory, then sys.path."""
    envs = builtin_envs()
    if name in envs:
        return envs[name]
    if ":" not in name:
        raise ValueError(
            f"env.name: unknown environment {name!r}; built-ins are {sorted(envs)}, or give 'module:ClassName'"
        )
    module, _, attr = name.partition(":")
    import os
    import sys

    for d in [*(search_dirs or []), os.getcwd()][::-1]:  # given folders, then the working directory
        if d not in sys.path:
            sys.path.insert(0, d)
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"env.name: cannot load {name!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, (Environment, AsyncEnvironment))):
        raise ValueError(f"env.name: {name!r} is not a subclass of Environment or AsyncEnvironment")
    return cls


def env_factory(
    name: str, options: dict | None = None, search_dirs: list[str] | None = None
) -> tuple[type, EnvFactory]:
    """The named environment's class (`resolve_env`) and a zero-argument factory that builds it with `options`
    as keyword arguments (the [env] options table). One instance is built now, so that an option the class does not take,
    or a value it refuses, is said before a run starts, naming env.options."""
    cls = resolve_env(name, search_dirs)
    options = dict(options or {})
    try:
        cls(**options)
    except TypeError as e:
        raise ValueError(f"env.options: {name!r} ({cls.__name__}) does not take these options: {e}") from None
    except ValueError as e:
        raise ValueError(f"env.options: {e}") from None
    if not options:
        return cls, cls
    return cls, functools.partial(cls, **options)
