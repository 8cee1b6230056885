"""Verifiable tasks (synthetic arithmetic, JSONL datasets), chat formatting of prompts, and reward functions."""

from __future__ import annotations

from typing import Any

from exactrl.tasks.arithmetic import ArithmeticTask
from exactrl.tasks.base import DatasetError, DatasetNotFoundError, Example, Task
from exactrl.tasks.chat import ChatTemplateError, load_chat_template, render_messages, render_prompt
from exactrl.tasks.jsonl import JsonlTask, load_dataset, load_jsonl
from exactrl.tasks.rewards import (
    BUILTIN_REWARDS,
    RewardComputer,
    RewardFn,
    RewardResult,
    extract_answer,
    parse_number,
    resolve_reward,
)

# Task kinds by the name a config uses; a plain dict, like BUILTIN_REWARDS.
TASK_TYPES: dict[str, type] = {"arithmetic": ArithmeticTask, "jsonl": JsonlTask, "parquet": JsonlTask}


def make_task(kind: str, **kwargs: Any) -> Task:
    """Build a task from its config name and keyword arguments, e.g. `make_task("jsonl", path="data.jsonl")`.

    "jsonl" and "parquet" are the same task over the two file formats."""
    if kind not in TASK_TYPES:
        raise ValueError(f"unknown task {kind!r}; available: {', '.join(sorted(TASK_TYPES))}")
    if kind in ("jsonl", "parquet"):
        kwargs.setdefault("fmt", kind)
    return TASK_TYPES[kind](**kwargs)


__all__ = [
    "BUILTIN_REWARDS",
    "TASK_TYPES",
    "ArithmeticTask",
    "ChatTemplateError",
    "DatasetError",
    "DatasetNotFoundError",
    "Example",
    "JsonlTask",
    "RewardComputer",
    "RewardFn",
    "RewardResult",
    "Task",
    "extract_answer",
    "load_chat_template",
    "load_dataset",
    "load_jsonl",
    "make_task",
    "parse_number",
    "render_messages",
    "render_prompt",
    "resolve_reward",
]
