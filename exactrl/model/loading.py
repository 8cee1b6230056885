"""One way to get a policy: a named preset (random init + byte tokenizer) or a local HF checkpoint directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from exactrl.model.config import ModelConfig, preset
from exactrl.model.hf import dtype_from_name, load_model, read_config
from exactrl.model.precision import apply_precision
from exactrl.model.qwen import CausalLM, build_model
from exactrl.model.tokenizer import Tokenizer, byte_tokenizer
from exactrl.ops import get_ops


def resolve_device(device: str | torch.device) -> str:
    """A device string ("auto", "cpu", "cuda", "cuda:N") or a torch.device -> the device string to build on."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(
            f"device must be a string such as 'cuda:0' or a torch.device, got {type(device).__name__}"
        )
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but no CUDA GPU is available")
    return device


def load_policy(
    *,
    preset_name: str | None = None,
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    exact: bool = True,
    fp32_lm_head: bool = False,
    seed: int = 0,
    tokenizer_path: str | Path | None = None,
    preset_overrides: dict[str, Any] | None = None,
    init_draws: str = "stream",
    precision: str = "dtype",
) -> tuple[CausalLM, Tokenizer]:
    """Build or load the policy and its tokenizer on `device` in `dtype`. preset_overrides: fields of the preset's
    ModelConfig to replace (e.g. {"num_layers": 4}: a large shape with fewer layers). init_draws: how a preset's
    random weights are drawn (`CausalLM.init_weights`). precision: the projections' arithmetic, "dtype" or "fp8"
    (`exactrl.model.precision.apply_precision`: the fp8 weights quantized from the loaded ones)."""
    _one_source(preset_name, path)
    device = resolve_device(device)
    torch_dtype = dtype_from_name(dtype)
    if path is not None:
        check_model_dir(path)
        model = load_model(path, device=device, dtype=torch_dtype, exact=exact, fp32_lm_head=fp32_lm_head)
        tok = Tokenizer.load(tokenizer_path or path)
    else:
        assert preset_name is not None  # `_one_source`: exactly one of the two is set
        cfg, tok = preset_and_tokenizer(preset_name, tokenizer_path, preset_overrides)
        model = build_model(
            cfg,
            device=device,
            dtype=torch_dtype,
            exact=exact,
            seed=seed,
            fp32_lm_head=fp32_lm_head,
            name=preset_name if not preset_overrides else f"{preset_name} {preset_overrides}",
            init_draws=init_draws,
        )
    check_vocab(tok, model.config.vocab_size, tokenizer_path or path, path or f"preset {preset_name}")
    return apply_precision(model, precision), tok


def _one_source(preset_name: str | None, path: str | Path | None) -> None:
    if (preset_name is None) == (path is None):
        raise ValueError(
            "give exactly one of a model preset (model.preset / --preset) or a checkpoint (model.path / --model)"
        )


def preset_and_tokenizer(
    preset_name: str, tokenizer_path: str | Path | None = None, preset_overrides: dict[str, Any] | None = None
) -> tuple[ModelConfig, Tokenizer]:
    """A preset's ModelConfig (its EOS the tokenizer's) and the tokenizer (the byte tokenizer unless one is given),
    the vocabularies checked: what `load_policy` builds a preset's model from."""
    tok = Tokenizer.load(tokenizer_path) if tokenizer_path else byte_tokenizer()
    check_vocab(tok, preset(preset_name).vocab_size, tokenizer_path, f"preset {preset_name}")
    return preset(preset_name, eos_token_id=tok.eos_token_id, **(preset_overrides or {})), tok


def policy_structure(
    *,
    preset_name: str | None = None,
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    exact: bool = True,
    fp32_lm_head: bool = False,
    tokenizer_path: str | Path | None = None,
) -> tuple[CausalLM, Tokenizer]:
    """`load_policy`'s model as its structure alone (parameters on the meta device, in `dtype`, with the ops of
    `device`), and its tokenizer: for a model whose every weight arrives from elsewhere (a generator rank's, filled
    by the trainers' weight sync), which may be split before it is given memory (`to_empty`)."""
    _one_source(preset_name, path)
    device = resolve_device(device)
    if path is not None:
        check_model_dir(path)
        cfg, tok = read_config(path), Tokenizer.load(tokenizer_path or path)
        check_vocab(tok, cfg.vocab_size, tokenizer_path or path, path)
    else:
        assert preset_name is not None  # `_one_source`: exactly one of the two is set
        cfg, tok = preset_and_tokenizer(preset_name, tokenizer_path)
    with torch.device("meta"):
        model = CausalLM(cfg, ops=get_ops(device, exact), fp32_lm_head=fp32_lm_head)
    return model.to(dtype=dtype_from_name(dtype)), tok


def check_vocab(tok: Tokenizer, model_vocab: int, tok_source: object, model_source: object) -> None:
    """Refuse a tokenizer whose ids the model cannot embed. A model vocabulary larger than the tokenizer's is
    normal (Qwen pads it to a multiple of 128); a smaller one would index past the embedding. Special and stop
    ids are checked against the tokenizer's own vocabulary when it loads, so they fit too."""
    if tok.vocab_size > model_vocab:
        raise ValueError(
            f"tokenizer vocab/model vocab mismatch: the tokenizer ({tok_source or 'built-in byte tokenizer'}) has "
            f"{tok.vocab_size} tokens but the model ({model_source}) has vocab_size {model_vocab}"
        )


def check_model_dir(path: str | Path) -> None:
    """A checkpoint directory that is not there: say so, where a relative path was looked for (the working
    directory), and, under a run's checkpoints/ folder, which checkpoints it does hold."""
    p = Path(path).expanduser()
    if p.is_dir():
        return
    where = "" if p.is_absolute() else f" (relative to the working directory {Path.cwd()})"
    if p.exists():
        raise FileNotFoundError(f"model {path}: not a directory{where}")
    note = ""
    for parent in p.parents:
        if parent.name == "checkpoints" and parent.is_dir():
            steps = sorted(c.name for c in parent.iterdir() if c.is_dir() and c.name.startswith("step-"))
            note = f"; {parent} holds {', '.join(steps) if steps else 'no checkpoint'}"
            break
    raise FileNotFoundError(f"model {path}: no such directory{where}{note}")
