"""From an example to prompt token ids, and the check that a prompt fits the run's limits.

Both the RL loop and the SFT warm start go through these, so a record that cannot be used is skipped, counted and
named (`path:line`) the same way in both, with the config key that would let it in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from exactrl.tasks.base import Example
from exactrl.tasks.chat import ChatTemplateError, render_prompt

logger = logging.getLogger(__name__)


class _Encodes(Protocol):
    def encode(self, text: str) -> list[int]: ...


def where(ex: Example) -> str:
    """Where an example came from: "path:line" for a dataset record, else the start of its prompt."""
    source = ex.meta.get("_source")
    if source:
        return str(source)
    text = ex.prompt if isinstance(ex.prompt, str) else repr(ex.prompt)
    return f"prompt {text[:40]!r}"


@dataclass
class PromptEncoder:
    """Turns task prompts into model input ids: the chat template when there is one (with `template_kwargs`, e.g.
    `enable_thinking=False`, passed to the template), else the prompt text as it is."""

    tokenizer: _Encodes
    chat_template: str | None
    system_prompt: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def text(self, ex: Example) -> str:
        try:
            return render_prompt(
                ex.prompt,
                chat_template=self.chat_template,
                system_prompt=self.system_prompt,
                **self.template_kwargs,
            )
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{where(ex)}: {e}") from e

    def __call__(self, ex: Example) -> list[int]:
        return self.tokenizer.encode(self.text(ex))


@dataclass
class PromptFilter:
    """Admits prompts that fit; counts the others and logs each (the first `max_logged`) with where it came from.

    A prompt fits when it has at least one token, at most `max_prompt_tokens`, and prompt + completion (the
    longest a rollout may sample, `max_new_tokens`, or a given SFT completion) fits `max_model_len`.
    """

    max_prompt_tokens: int
    max_model_len: int
    max_new_tokens: int
    log: Callable[[str], None] = logger.warning
    max_logged: int = 20
    skipped: int = 0

    def reason(self, ids: list[int], completion_len: int | None = None) -> str | None:
        """Why these prompt ids cannot be used, naming the config key to change; None when they can."""
        n = len(ids)
        if n == 0:
            return "the prompt encodes to no tokens"
        if n > self.max_prompt_tokens:
            return (
                f"the prompt has {n} tokens, more than task.max_prompt_tokens = {self.max_prompt_tokens}; to keep it, "
                f"raise task.max_prompt_tokens to {n} and engine.max_model_len to at least {n + self.max_new_tokens}"
            )
        new = self.max_new_tokens if completion_len is None else completion_len
        if n + new > self.max_model_len:
            what = "sampling.max_tokens" if completion_len is None else "answer"
            return (
                f"prompt ({n} tokens) + {what} ({new}) is longer than engine.max_model_len = {self.max_model_len}; "
                f"raise engine.max_model_len to {n + new} to keep it"
            )
        return None

    def reject(self, ex: Example, why: str) -> None:
        """Count a skipped example and log why."""
        self.skipped += 1
        if self.skipped <= self.max_logged:
            self.log(f"{where(ex)}: {why}: skipped")
        elif self.skipped == self.max_logged + 1:
            self.log(f"more than {self.max_logged} prompts skipped: further ones are counted, not listed")

    def admit(self, ex: Example, ids: list[int], completion_len: int | None = None) -> bool:
        why = self.reason(ids, completion_len)
        if why is None:
            return True
        self.reject(ex, why)
        return False


__all__ = ["PromptEncoder", "PromptFilter", "where"]
