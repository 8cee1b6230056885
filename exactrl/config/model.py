"""The `[model]` and `[lora]` sections: which model to train, and its adapters."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal

from exactrl.config.errors import _check_at_least, _check_positive, _fail

Dtype = Literal["float32", "bfloat16"]
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LoraInit = Literal["default", "gaussian"]


@dataclass
class LoraConfig:
    """LoRA: train low-rank adapters on the decoder's projections instead of every weight (rank 0 = off)."""

    rank: int = 0
    """Adapter rank r; 0 = no LoRA (full fine-tune). The base weights are then frozen in the model dtype."""
    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank (alpha / sqrt(rank) with rslora)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Projections (HF names) that get adapters in every layer; default all seven linear projections."""
    init: LoraInit = "default"
    """Init of A (B starts at 0 either way): "default" = kaiming-uniform as PEFT, "gaussian" = N(0, 1/rank)."""
    rslora: bool = False
    """Rank-stabilised scale alpha / sqrt(rank) instead of alpha / rank."""
    dropout: float = 0.0
    """Must be 0: dropout would make the trainer's forward differ from the engine's (no exact logprobs)."""
    path: str | None = None
    """A PEFT adapter directory to start from (adapter_config.json + adapter_model.safetensors); its rank,
    alpha and targets must match this section."""

    def validate(self) -> None:
        _check_at_least(self.rank, 0, "lora.rank")
        if self.rank == 0:
            if self.path is not None:
                _fail("lora.path", "is set but lora.rank is 0 (LoRA off): set the adapter's rank")
            return
        _check_positive(self.alpha, "lora.alpha")
        if not self.target_modules:
            _fail("lora.target_modules", f"must name at least one of {list(LORA_TARGETS)}")
        for i, t in enumerate(self.target_modules):
            if t not in LORA_TARGETS:
                close = difflib.get_close_matches(t, LORA_TARGETS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                _fail(f"lora.target_modules[{i}]", f"{t!r} is not one of {list(LORA_TARGETS)}{hint}")
        if len(set(self.target_modules)) != len(self.target_modules):
            _fail("lora.target_modules", f"names a module twice: {self.target_modules}")
        if self.dropout != 0:
            _fail(
                "lora.dropout",
                f"must be 0, got {self.dropout!r}: LoRA dropout is not supported, since a random mask in the "
                "trainer's forward would break the bitwise equality with the engine's logprobs",
            )
        if self.path is not None and not self.path.strip():
            _fail("lora.path", "must not be empty")


@dataclass
class ModelConfig:
    """Which model to train: a random-init preset shape or a local Hugging Face checkpoint."""

    preset: str | None = None
    """Name of a built-in model shape to initialise randomly (set exactly one of preset and path)."""
    path: str | None = None
    """Local Hugging Face checkpoint directory (config.json + safetensors) to load (exactly one of preset/path)."""
    dtype: Dtype = "float32"
    """Parameter and activation dtype: "float32" or "bfloat16"."""
    fp32_lm_head: bool = False
    """Keep the LM head (final projection to vocabulary logits) in float32 even when dtype is bfloat16."""
    precision: Literal["dtype", "fp8"] = "dtype"
    """The projections' arithmetic: "dtype" (in the model dtype) or "fp8" (attention, MLP and expert weights in e4m3 with a scale per 128 x 128 block, activations per token and 128-channel group; the LM head, norms and attention stay in dtype; engine and trainer share it bitwise; docs/fp8.md). fp8 on CUDA needs compute capability 8.9+."""
    tokenizer: str | None = None
    """Path to a tokenizer.json; defaults to the one inside path."""
    init_draws: Literal["stream", "keyed"] = "stream"
    """A preset's random weights: "stream" (one generator draws every matrix in order on one core: the presets' values as they have always been) or "keyed" (each matrix from its own generator seeded by the run's seed and its name, drawn on several threads: other values, the same on every device, dtype and thread count; a 30B preset's one-core draws take minutes). Not used with model.path."""

    def validate(self) -> None:
        if self.precision not in ("dtype", "fp8"):
            _fail("model.precision", f'must be "dtype" or "fp8", got {self.precision!r}')
        if self.init_draws not in ("stream", "keyed"):
            _fail("model.init_draws", f'must be "stream" or "keyed", got {self.init_draws!r}')
        if self.preset is not None and self.path is not None:
            # The usual way here: a config written for a preset, pointed at a checkpoint with --set model.path=...
            _fail(
                "model.preset",
                f"({self.preset!r}) and model.path ({self.path!r}) are both set: set exactly one of them. To load "
                "the checkpoint instead of the preset, also set model.preset=none (--set model.preset=none)",
            )
        if self.preset is None and self.path is None:
            _fail("model.preset", "or model.path: set exactly one of them")
        if self.preset is not None and not self.preset.strip():
            _fail("model.preset", "must not be empty")
        if self.path is not None and not self.path.strip():
            _fail("model.path", "must not be empty")
