"""HF-format checkpoints: config.json + *.safetensors (sharded with an index) + tokenizer files.

Loading validates everything before touching the model: an unsupported architecture, a missing tensor or a
tensor of the wrong shape is refused with an error naming it, and nothing is partially loaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from exactrl.model.config import ModelConfig
from exactrl.model.files import CheckpointError, read_json, writing
from exactrl.model.qwen import CausalLM
from exactrl.model.tokenizer import Tokenizer
from exactrl.ops import get_ops
from exactrl.progress import Progress, amount

# Tensors some exporters write that carry no information for us.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]


def read_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected an HF checkpoint directory)")
    d = read_json(path)
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return ModelConfig.from_hf(d, where=str(path))


def run_model_config(cfg: Any) -> ModelConfig:
    """The ModelConfig of a run config (`exactrl.config.RunConfig`): its model.preset's shape, or the checkpoint's
    config.json at model.path (a disk read: a run reads it once, `exactrl.train.resolved.resolve_run`)."""
    from exactrl.model.config import preset

    if cfg.model.path is not None:
        return read_config(cfg.model.path)
    return preset(cfg.model.preset)


def _inside(model_dir: Path, fname: object, index: Path) -> Path:
    """The file `fname` an index names, refused unless it resolves (symlinks followed) inside model_dir: an index
    is data from a stranger and must not make us read /etc/... or ../other-model/..."""
    if not isinstance(fname, str) or not fname:
        raise CheckpointError(f"{index}: weight_map entry {fname!r} is not a file name")
    if Path(fname).is_absolute():
        raise CheckpointError(
            f"{index}: weight_map names an absolute path {fname!r}; files must be inside {model_dir}"
        )
    root = model_dir.resolve()
    path = (model_dir / fname).resolve()
    if not path.is_relative_to(root):
        raise CheckpointError(
            f"{index}: weight_map file {fname!r} resolves outside the checkpoint directory {model_dir}"
        )
    if not path.is_file():
        raise CheckpointError(f"{index}: weight_map names {fname!r}, which is not a file in {model_dir}")
    return path


def _open_safetensors(f: Path):
    """safe_open with a one-line error naming the file when its header is truncated or corrupt."""
    try:
        return safe_open(str(f), framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError): both mean a bad file
        raise CheckpointError(f"{f}: not a readable safetensors file ({_first_line(e)})") from None


def _embedding_dtype(f: Path) -> torch.dtype:
    """The dtype of the checkpoint's embedding (the model's dtype when none is asked for), from one row of it."""
    name = "model.embed_tokens.weight"
    with _open_safetensors(f) as sf:
        try:
            return sf.get_slice(name)[0:1].dtype
        except Exception as e:  # a truncated file: the same error the full read gives
            raise CheckpointError(f"{f}: tensor {name} is unreadable ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        doc = read_json(index)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map object")
        resolved: dict[str, Path] = {}
        return {name: resolved.setdefault(f, _inside(model_dir, f, index)) for name, f in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (pickle checkpoints are not loaded)")
    out: dict[str, Path] = {}
    for f in files:
        with _open_safetensors(f) as sf:
            for name in sf.keys():
                out[name] = f
    return out


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    exact: bool = True,
    fp32_lm_head: bool = False,
) -> CausalLM:
    """Load an HF Qwen2/Qwen3/Llama checkpoint directory into a `CausalLM` on `device` (dtype: the checkpoint's
    own when None)."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg, ops=get_ops(device, exact), fp32_lm_head=fp32_lm_head)
    expected = {
        name: tuple(t.shape) for name, t in model.state_dict().items()
    }  # HF's names (packed q/k/v split)
    files = _tensor_files(model_dir)
    if cfg.tie_word_embeddings:
        files.pop("lm_head.weight", None)  # some exporters write the tied head too
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(n for n in set(files) - set(expected) if not n.endswith(_IGNORED_SUFFIXES))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(
                f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)"
            )
        if unexpected:
            parts.append(f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        raise ValueError(
            f"{model_dir}: checkpoint does not match the {cfg.architecture} config: " + "; ".join(parts)
        )
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    target_dtype = dtype if dtype is not None else _embedding_dtype(files["model.embed_tokens.weight"])
    total = sum(math.prod(shape) for shape in expected.values())
    desc = f"loading {model_dir} ({amount(total, 'params')}, {len(by_file)} files)"
    with Progress(desc, total, "params") as bar:
        for f, names in by_file.items():
            with _open_safetensors(f) as sf:
                present = set(sf.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"{f}: has no tensor {name}, which the index puts there")
                    try:
                        t = sf.get_tensor(name)
                    except Exception as e:  # a tensor whose bytes run past the end of a truncated file
                        raise CheckpointError(
                            f"{f}: tensor {name} is unreadable ({_first_line(e)})"
                        ) from None
                    if tuple(t.shape) != expected[name]:
                        raise ValueError(
                            f"{f}: tensor {name} has shape {tuple(t.shape)}, the config needs {expected[name]}"
                        )
                    # To the device as it is read: the host holds one tensor at a time, not the checkpoint.
                    state[name] = t.to(device=device, dtype=target_dtype)
                    bar.update(t.numel())
    model.load_state_dict(state, assign=True, strict=True)
    return model


def save_model(
    model: CausalLM,
    out_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Write `model` (and the tokenizer) as an HF checkpoint that transformers can load."""
    with writing(out_dir, "the model"):  # a full disk or a refused folder is named, not a traceback
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # copy=True: the q/k/v and gate/up entries are views of one packed tensor, and safetensors wants owners.
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
        cfg = model.config
        eos = tokenizer.eos_token_id if tokenizer is not None else cfg.eos_token_id
        hf = cfg.to_hf(dtype_name(model.dtype))
        hf["eos_token_id"] = eos
        (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        gen = {"eos_token_id": tokenizer.stop_token_ids if tokenizer is not None else eos, "do_sample": True}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        for old in out.glob("*.safetensors"):
            old.unlink()
        if len(shards) == 1:
            save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
            index = out / "model.safetensors.index.json"
            if index.exists():
                index.unlink()
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(out / fname), metadata={"format": "pt"})
                weight_map.update({name: fname for name in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            (out / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
            )
        if tokenizer is not None:
            tokenizer.save(out)
