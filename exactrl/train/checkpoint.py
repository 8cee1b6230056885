"""Atomic checkpoints: write to a temporary directory, fsync, rename, then update `latest` last.

Layout of `checkpoints/step-000010/`:
  policy/              HF checkpoint (config.json, *.safetensors, tokenizer) that transformers can load
  critic.safetensors   the PPO critic's weights (when there is one)
  optimizer.pt         optimizer state(s), loaded with torch.load(weights_only=True): tensors and numbers only
  state.json           step, task/data position, RNG states, anything else the loop needs to resume bitwise
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from exactrl.model.files import CheckpointError, writing
from exactrl.model.hf import load_model, read_config, save_model
from exactrl.model.lora import ADAPTER_WEIGHTS, LoraSpec, read_adapter_config
from exactrl.model.qwen import CausalLM
from exactrl.model.tokenizer import Tokenizer

# Partial rollouts' groups in flight (exactrl/train/partial.py): the one-process pool's file, and a sharded
# checkpoint's pools, POOLS_DIR/rank<r>-of-<N>/PARTIAL_FILE. Here, beside the rest of a checkpoint's layout, so that
# the preflight reads them without importing the driver's modules.
PARTIAL_FILE = "offpolicy_partial.json"
POOLS_DIR = "offpolicy_partial"


def fsync_dir(path: str | Path) -> None:
    """fsync every file under path, then the directory itself (for atomic checkpoints)."""
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    st = {
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np.random.get_state()),
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(_tupled(st["python"]))
    np_state = st["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in st["cuda"]])


def _jsonable(x):
    if isinstance(x, tuple | list):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.integer):
        return int(x)
    return x


def _tupled(x):
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


def write_policy(
    model: CausalLM, out: Path, tokenizer: Tokenizer | None, frozen_from: Path | None = None
) -> bool:
    """A checkpoint's `policy/` (an HF checkpoint of `model`). `frozen_from`: an earlier checkpoint's `policy/`
    written from the same, frozen weights (with LoRA the base never changes, and `policy/` holds the base alone):
    its files are hard-linked instead of written again, the same bytes and one copy on disk. Where linking fails
    (another filesystem, a file gone) the files are written. Returns whether they were linked."""
    if frozen_from is not None and frozen_from.is_dir():
        try:
            out.mkdir(parents=True)
            for f in sorted(frozen_from.iterdir()):
                if not f.is_file():
                    raise OSError(f"not a plain file: {f}")
                os.link(f, out / f.name)
            return True
        except OSError:
            shutil.rmtree(out, ignore_errors=True)
    save_model(model, out, tokenizer=tokenizer)
    return False


def save_checkpoint(
    ckpt_root: str | Path,
    step: int,
    *,
    model: CausalLM,
    tokenizer: Tokenizer,
    optimizers: dict[str, Any],
    state: dict[str, Any],
    critic: torch.nn.Module | None = None,
    keep: int = 2,
    write_extra: Callable[[Path], object] | None = None,
    frozen_policy_from: Path | None = None,
) -> Path:
    """Write checkpoint `step-N` under `ckpt_root` atomically (see `publish_checkpoint`); `frozen_policy_from`
    as in `write_policy`."""
    root = Path(ckpt_root)
    name = f"step-{step:06d}"
    with writing(root / name, "the checkpoint"):  # no space, no permission: one line naming the path
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        write_policy(model, tmp / "policy", tokenizer, frozen_policy_from)
        if critic is not None:
            save_file(
                {k: v.detach().to("cpu", copy=True).contiguous() for k, v in critic.state_dict().items()},
                str(tmp / "critic.safetensors"),
            )
        torch.save({k: v.state_dict() for k, v in optimizers.items()}, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **state, "rng": rng_state()}) + "\n")
        if write_extra is not None:  # more files of this checkpoint (LoRA adapters), inside the atomic rename
            write_extra(tmp)
        return publish_checkpoint(root, tmp, name, keep)


def publish_checkpoint(root: Path, tmp: Path, name: str, keep: int) -> Path:
    """Make the fully written `tmp` the checkpoint `root/name`: fsync, rename into place, then point `latest` at
    it and prune the oldest. `latest` is written last and atomically: a crash before that leaves the previous
    checkpoint current."""
    final = root / name
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(name + "\n")
    with open(latest_tmp) as f:
        os.fsync(f.fileno())
    os.replace(latest_tmp, root / "latest")
    _prune(root, keep, name)
    return final


def _prune(root: Path, keep: int, current: str) -> None:
    if keep <= 0:
        return
    ckpts = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for p in ckpts[:-keep]:
        if p.name != current:
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The checkpoint `latest` points at; None when there is no `latest`. A `latest` that names a missing folder
    is refused (ResumeError): a run with checkpoints must not silently start over."""
    root = Path(ckpt_root)
    f = root / "latest"
    if not f.is_file():
        return None
    name = f.read_text().strip()
    p = root / name
    if not name or not p.is_dir():
        others = sorted(x.name for x in root.iterdir() if x.is_dir() and x.name.startswith("step-"))
        raise ResumeError(
            f"{f} names {name!r}, which is not a checkpoint folder in {root}"
            + (
                f" (there: {', '.join(others)}; write one of those names into {f} to resume from it)"
                if others
                else ""
            )
        )
    return p


class ResumeError(ValueError):
    """A checkpoint that cannot be loaded into this run; raised before anything in the run folder changes."""


# ModelConfig fields that decide the tensors' names and shapes: a checkpoint differing in one cannot load.
_SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
)


def safetensors_header(f: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header, after checking that the file is as long as the
    header says (a file cut short by a crash or a full disk is caught here, before any tensor is read)."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise CheckpointError(f"{f}: truncated safetensors file ({size} bytes, no complete header)")
        try:
            meta = json.loads(fh.read(n))
            entries = {k: v for k, v in meta.items() if k != "__metadata__"}
            end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
            shapes = {k: tuple(int(d) for d in v["shape"]) for k, v in entries.items()}
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise CheckpointError(f"{f}: corrupt safetensors header ({e})") from None
    if 8 + n + end != size:
        raise CheckpointError(
            f"{f}: {size} bytes, but its header describes {8 + n + end}: the file is truncated or corrupt"
        )
    return shapes


def check_resumable(
    path: str | Path,
    model: CausalLM,
    *,
    critic: bool = False,
    lora: Any = None,
) -> dict[str, Any]:
    """Read-only checks that the checkpoint at `path` loads into `model` (and this run's critic and LoRA
    adapters), made before the run folder changes: a resume that cannot load is refused with every reason, not
    found out after config.toml and metrics.jsonl were rewritten. Checks state.json, the policy's config.json
    (model shape), every safetensors file's header and length, the optimizer file (or DCP folder), the critic,
    and the adapters against `lora` (the run's [lora] section; None = no LoRA). Returns state.json.
    Raises ResumeError naming the checkpoint and what does not fit."""
    path = Path(path)
    problems: list[str] = []
    state: dict[str, Any] = {}
    try:
        state = json.loads((path / "state.json").read_text())
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"state.json is unreadable ({type(e).__name__}: {e})")
    policy = path / "policy"
    try:
        theirs = read_config(policy)
    except (OSError, ValueError) as e:
        problems.append(str(e))
    else:
        ours = model.config
        diff = [
            f"{k} {getattr(theirs, k)} (checkpoint) vs {getattr(ours, k)} (this config's model)"
            for k in _SHAPE_FIELDS
            if getattr(theirs, k) != getattr(ours, k)
        ]
        if diff:
            problems.append("its model has another shape: " + "; ".join(diff))
        else:
            expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            problems += _tensor_problems(policy, expected)
    if (path / "dcp").is_dir():
        if not (path / "dcp" / ".metadata").is_file():
            problems.append("dcp/.metadata is missing (an incomplete sharded checkpoint)")
    else:
        opt = path / "optimizer.pt"
        if not opt.is_file() or not zipfile.is_zipfile(opt):
            problems.append(f"{opt.name} is {'not a readable torch file' if opt.is_file() else 'missing'}")
        if critic:
            f = path / "critic.safetensors"
            if not f.is_file():
                problems.append(
                    "critic.safetensors is missing: this config trains a critic (PPO), the run did not"
                )
            else:
                problems += _header_problems(f)
    problems += _adapter_problems(path / "adapter", lora)
    if problems:
        raise ResumeError(f"cannot resume from {path}:\n  - " + "\n  - ".join(problems))
    return state


def _header_problems(f: Path) -> list[str]:
    try:
        safetensors_header(f)
    except CheckpointError as e:
        return [str(e)]
    return []


def _tensor_problems(policy: Path, expected: dict[str, tuple[int, ...]]) -> list[str]:
    files = sorted(policy.glob("*.safetensors"))
    if not files:
        return [f"{policy}: no *.safetensors files"]
    out, seen = [], {}
    for f in files:
        try:
            seen.update(safetensors_header(f))
        except CheckpointError as e:
            out.append(str(e))
    if out:
        return out
    bad = [f"{k} {seen[k]} vs {v}" for k, v in expected.items() if k in seen and seen[k] != v]
    if bad:
        out.append(f"{policy}: tensor shapes differ from this config's model: {', '.join(bad[:4])}")
    return out


def _adapter_problems(adapter: Path, lora: Any) -> list[str]:
    rank = int(getattr(lora, "rank", 0) or 0) if lora is not None else 0
    if not adapter.is_dir():
        if rank > 0:
            return [
                f"it holds no LoRA adapters (no {adapter.name}/), and this config trains them (lora.rank = {rank})"
            ]
        return []
    if rank == 0:
        return [
            f"it holds LoRA adapters ({adapter.name}/), and this config has LoRA off (lora.rank = 0): the trained "
            "adapters would be dropped"
        ]
    try:
        info = read_adapter_config(adapter)
    except (OSError, ValueError) as e:
        return [str(e)]
    out = []
    spec = LoraSpec(rank=rank, alpha=float(lora.alpha), rslora=bool(lora.rslora))
    theirs = LoraSpec(rank=info.rank, alpha=info.alpha, rslora=info.rslora)
    if (info.rank, theirs.scale) != (rank, spec.scale):
        out.append(
            f"its adapters have rank {info.rank} / scale {theirs.scale}, this config's lora: rank {rank} / "
            f"scale {spec.scale}"
        )
    targets = list(getattr(lora, "target_modules", []) or [])
    if targets and info.target_modules and sorted(info.target_modules) != sorted(targets):
        out.append(f"its adapters target {sorted(info.target_modules)}, this config's lora {sorted(targets)}")
    f = adapter / ADAPTER_WEIGHTS
    out += _header_problems(f) if f.is_file() else [f"{f} is missing"]
    return out


def load_checkpoint(
    path: str | Path,
    *,
    model: CausalLM,
    optimizers: dict[str, Any],
    critic: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """Load weights into `model` (and critic) in place, restore optimizer and RNG states; return state.json."""
    path = Path(path)
    loaded = load_model(path / "policy", device=model.device, dtype=model.dtype, exact=model.ops.exact)
    with torch.no_grad():  # in place: the parameters stay the optimizer's and the captured graphs' tensors
        model.load_state_dict(loaded.state_dict(), strict=True)
    if critic is not None:
        sd = load_file(str(path / "critic.safetensors"), device=str(model.device))
        critic.load_state_dict(sd)
    opt_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    for k, opt in optimizers.items():
        opt.load_state_dict(opt_state[k])
    state = json.loads((path / "state.json").read_text())
    set_rng_state(state["rng"])
    return state
