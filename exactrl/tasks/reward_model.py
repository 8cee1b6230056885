"""A learned reward: a Hugging Face `*ForSequenceClassification` checkpoint scoring (prompt, completion) pairs.

The conversation `[prompt messages..., {"role": "assistant", "content": completion}]` is rendered with the reward
model's own chat template (its tokenizer's; without one, prompt text + completion), tokenized by its tokenizer and
scored in batches on the run's device. The score is the logit of `label` at the last token of the sequence, which
is where transformers' `*ForSequenceClassification` pools ("the last non-pad token"). We pool by the attention
mask of our own right-padded batch rather than by searching for the pad id, so a checkpoint without a pad token
scores batches too, and a text that ends in the pad token is not cut short.

Loaded with transformers (an optional dependency), from a local directory, safetensors only (no pickle), no remote
code. Supported families: Qwen2, Qwen3, Llama; others are refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exactrl.tasks.base import Example

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
_DTYPES = ("float32", "bfloat16", "float16")


def torch_no_grad_lazy(fn: Any) -> Any:
    """`torch.no_grad()` applied at call time, so importing this module does not import torch."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


class RewardModel:
    """A batched reward function backed by a sequence-classification model; see the module docstring."""

    # Read by RewardComputer: called once per batch with lists, in the calling process (the model lives on the
    # run's device; a worker process would need its own copy and its own CUDA context).
    batched = True
    exactrl_inline = True

    def __init__(
        self,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        label: int = 0,
        batch_size: int = 16,
        max_tokens: int = 4096,
    ) -> None:
        try:
            import torch
            import transformers
        except ImportError as e:
            raise ImportError("reward.model needs the transformers package (pip install transformers)") from e
        if dtype not in _DTYPES:
            raise ValueError(f"reward model dtype must be one of {_DTYPES}, got {dtype!r}")
        if batch_size < 1 or max_tokens < 2:
            raise ValueError(f"batch_size must be >= 1 and max_tokens >= 2, got {batch_size}, {max_tokens}")
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(
                f"reward.model: no config.json in {self.path} (a local checkpoint directory)"
            )
        config = transformers.AutoConfig.from_pretrained(self.path, local_files_only=True)
        archs = list(getattr(config, "architectures", None) or [])
        if config.model_type not in SUPPORTED_MODEL_TYPES or not any(
            a.endswith("ForSequenceClassification") for a in archs
        ):
            raise ValueError(
                f"reward.model {self.path}: a {config.model_type} checkpoint with architectures {archs}; supported: "
                f"*ForSequenceClassification of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if not 0 <= label < config.num_labels:
            raise ValueError(
                f"reward.model_label = {label}, but {self.path} has {config.num_labels} labels (0..{config.num_labels - 1})"
            )
        torch_dtype = getattr(torch, dtype)
        load_kw: dict[str, Any] = {"local_files_only": True, "use_safetensors": True}
        try:
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                self.path, dtype=torch_dtype, **load_kw
            )
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                self.path, torch_dtype=torch_dtype, **load_kw
            )
        self.model = model.to(device).eval().requires_grad_(False)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.device = torch.device(device)
        self.label = label
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.__qualname__ = "reward_model"  # its name in RewardResult.per_function and the metrics

    def text(self, completion: str, example: Example) -> str:
        """The text the reward model reads for one sample."""
        prompt = example.prompt
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            messages = [*messages, {"role": "assistant", "content": completion}]
            return str(self.tokenizer.apply_chat_template(messages, tokenize=False))  # tokenize=False: a str
        if not isinstance(prompt, str):
            prompt = "\n".join(m["content"] for m in prompt)
        return prompt + completion

    def encode(self, completion: str, example: Example) -> list[int]:
        ids = self.tokenizer(self.text(completion, example), add_special_tokens=True)["input_ids"]
        # The score is read at the end: keep the end of an over-long text.
        return list(ids[-self.max_tokens :])

    def __call__(
        self, completions: Sequence[str], answers: Sequence[str], examples: Sequence[Example]
    ) -> list[float]:

        ids = [self.encode(c, e) for c, e in zip(completions, examples)]
        # Similar lengths together: less padding.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores = [0.0] * len(ids)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            for i, score in zip(rows, self.score_ids([ids[i] for i in rows]).tolist()):
                scores[i] = score
        return scores

    @torch_no_grad_lazy
    def score_ids(self, batch: list[list[int]]) -> Any:
        """`[B]` float32 scores of token-id sequences (right-padded into one batch)."""
        import torch

        width = max(len(s) for s in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, seq in enumerate(batch):
            input_ids[r, : len(seq)] = torch.tensor(seq)
            mask[r, : len(seq)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        hidden = self.model.base_model(
            input_ids=input_ids, attention_mask=mask
        ).last_hidden_state  # [B, L, H]
        last = mask.sum(1) - 1  # right padding: the last real token of each row
        pooled = hidden[torch.arange(len(batch), device=self.device), last]  # [B, H]
        return self.model.score(pooled)[:, self.label].float().cpu()
