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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from exactrl.model.files import writing
from exactrl.model.hf import load_model, save_model
from exactrl.model.qwen import CausalLM
from exactrl.model.tokenizer import Tokenizer


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
    f = Path(ckpt_root) / "latest"
    if not f.is_file():
        return None
    p = Path(ckpt_root) / f.read_text().strip()
    return p if p.is_dir() else None


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
