"""Sharded checkpoints of an FSDP2 run with torch.distributed.checkpoint (DCP), resumable at any world size.

A checkpoint directory `step-NNNNNN/` holds:
  dcp/         the fp32 master weights (policy, critic) and AdamW moments as DTensors, written by every rank
               for its own shards; DCP reshards them on load, so a run saved on 2 ranks resumes on 1 or 4
  policy/      an HF checkpoint (safetensors + tokenizer) of the full weights in the model dtype, written by
               rank 0 from the engine replica (the gathered weights), loadable by transformers
  adapter/     with LoRA: the adapters in PEFT's format (policy/ then holds the frozen base), as on one device
               (the caller's `write_extra`)
  state.json   step, data position, totals (rank 0; every rank runs the same data stream)
  offpolicy_pending/rank<r>-of-<N>/
               with algorithm.max_off_policy_steps = 1: each rank's share of the batch sampled ahead (the caller's
               `write_rank_extra`, every rank)

As on one device, the directory is assembled under a temporary name and renamed into place, and `latest` is
written last: a crash mid-save leaves the previous checkpoint current.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from exactrl.distributed.env import DistContext
from exactrl.distributed.shared_fs import require_every_shard
from exactrl.model.precision import fp8_weights_changed
from exactrl.model.qwen import CausalLM
from exactrl.train.checkpoint import publish_checkpoint, rng_state, set_rng_state
from exactrl.train.optim import MasterAdamW


def _as_dtensor(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A local state tensor with the layout of its (sharded) parameter, so DCP can reshard it. Offloaded AdamW
    moments (train.offload = "optimizer") are host buffers while the parameter's mesh may be a GPU's: there the
    DTensor gets a mesh of the same ranks and process group typed for the host, because `DTensor.from_local` copies
    a tensor of another device type onto the mesh's device, so a save would bring every moment shard to the GPU at
    once and a load would fill those copies, not the host buffers. DCP runs no collective on a tensor's mesh; it
    reads and writes the local tensor in place."""
    if not isinstance(like, DTensor):
        return local
    mesh = like.device_mesh
    if local.device.type != mesh.device_type:
        mesh = _mesh_on(mesh, local.device.type)
    return DTensor.from_local(
        local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


# (id of a mesh, device type) -> (that mesh, held so that its id is not reused by another; the mesh on the device).
_MESHES: dict[tuple[int, str], tuple[DeviceMesh, DeviceMesh]] = {}


def _mesh_on(mesh: DeviceMesh, device_type: str) -> DeviceMesh:
    """`mesh` (its ranks, dimension names and process groups) with another device type; built once per mesh."""
    key = (id(mesh), device_type)
    if key not in _MESHES:
        groups = [mesh.get_group(d) for d in range(mesh.ndim)]
        _MESHES[key] = (
            mesh,
            DeviceMesh.from_group(
                groups[0] if mesh.ndim == 1 else groups,
                device_type,
                mesh=mesh.mesh,
                mesh_dim_names=mesh.mesh_dim_names,
            ),
        )
    return _MESHES[key][1]


def _optimizer_tree(opt: MasterAdamW, module: nn.Module) -> dict[str, Any]:
    """{parameter name: {exp_avg, exp_avg_sq, step}} over `opt`'s parameters, as tensors DCP reads and writes
    in place (state is created, zeroed, where the optimizer has not stepped yet: in the host buffers when it is
    offloaded)."""
    names = {id(p): n for n, p in module.named_parameters()}
    opt.init_state()
    opt.synchronize()  # offload: the copies into the host buffers are queued, not done
    tree: dict[str, Any] = {}
    for p, m in zip(opt.params, opt.master):
        st = opt.opt.state[m]
        tree[names[id(p)]] = {
            "exp_avg": _as_dtensor(st["exp_avg"], p),
            "exp_avg_sq": _as_dtensor(st["exp_avg_sq"], p),
            "step": st["step"],
        }
    return tree


def _weights(module: nn.Module, opt: MasterAdamW | None) -> dict[str, torch.Tensor]:
    """The fp32 weights by name: the parameters (sharded or fp32), or the optimizer's fp32 masters of a 16-bit
    model on one device (so a sharded checkpoint resumes without torchrun, and the other way round)."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    if opt is not None and opt.has_master:
        names = {id(p): n for n, p in module.named_parameters()}
        out.update({names[id(p)]: m for p, m in zip(opt.params, opt.master)})
    return out


def _tree(model: nn.Module, optimizers: dict[str, MasterAdamW], critic: nn.Module | None) -> dict[str, Any]:
    tree: dict[str, Any] = {"policy": _weights(model, optimizers.get("policy"))}
    if critic is not None:
        tree["critic"] = _weights(critic, optimizers.get("critic"))
    for key, opt in optimizers.items():
        owner = critic if key == "critic" else model
        assert owner is not None  # a critic's optimizer comes with the critic
        tree[f"optim/{key}"] = _optimizer_tree(opt, owner)
    return tree


def save_sharded_checkpoint(
    ctx: DistContext,
    ckpt_root: str | Path,
    step: int,
    *,
    model: nn.Module,
    engine_model: CausalLM,
    tokenizer: Any,
    optimizers: dict[str, MasterAdamW],
    state: dict[str, Any],
    critic: nn.Module | None = None,
    keep: int = 2,
    write_extra: Callable[[Path], object] | None = None,
    frozen_policy_from: Path | None = None,
    write_rank_extra: Callable[[Path], object] | None = None,
) -> Path:
    """Every rank calls this at the same step; returns the checkpoint's directory. `write_extra` (rank 0: more
    files of the checkpoint, e.g. LoRA adapters) and `frozen_policy_from` as in
    `exactrl.train.checkpoint.save_checkpoint`. `write_rank_extra` (every rank, given on all or none: files of
    its own, e.g. its off-policy pending batch) writes into the directory being assembled, before rank 0
    publishes it."""
    from exactrl.train.checkpoint import write_policy

    root = Path(ckpt_root)
    name = f"step-{step:06d}"
    final, tmp = root / name, root / f".tmp-{name}"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    ctx.barrier()
    with torch.no_grad():
        dcp.save(_tree(model, optimizers, critic), checkpoint_id=str(tmp / "dcp"), process_group=ctx.group)
    if write_rank_extra is not None:
        write_rank_extra(tmp)
        ctx.barrier()  # every rank's files are in before rank 0 renames the folder into place
    # Every rank's shard in it as rank 0 sees it: published whole or not at all (every rank raises).
    require_every_shard(ctx, tmp, name)
    if ctx.is_main:
        write_policy(engine_model, tmp / "policy", tokenizer, frozen_policy_from)
        if write_extra is not None:
            write_extra(tmp)
        meta = {"step": step, **state, "rng": rng_state(), "world_size": ctx.world_size}
        (tmp / "state.json").write_text(json.dumps(meta) + "\n")
        publish_checkpoint(root, tmp, name, keep)
    ctx.barrier()
    return final


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "dcp").is_dir()


def load_sharded_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizers: dict[str, MasterAdamW],
    critic: nn.Module | None = None,
    process_group: Any = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint into this run's (sharded) model and optimizers in place, at whatever world
    size this run has; returns state.json. process_group: the ranks that load (None: every rank of the job; the
    trainers' group in a disaggregated run)."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is a single-device checkpoint (no dcp/ folder): a torchrun run resumes from checkpoints "
            "written under torchrun; resume it without torchrun, or start this run from its policy/ folder "
            "with model.path"
        )
    tree = _tree(model, optimizers, critic)
    with torch.no_grad():
        dcp.load(tree, checkpoint_id=str(path / "dcp"), process_group=process_group)
        for opt in optimizers.values():
            if opt.has_master:  # one device, bf16 model: the fp32 masters were loaded; refresh the weights
                params: list[torch.Tensor] = list(opt.params)
                torch._foreach_copy_(params, opt.master)
    # fp8: DCP wrote the shards in place, which no version counter records; re-quantize from the next gathers.
    for m in (model, critic):
        if m is not None:
            fp8_weights_changed(m)
    state = json.loads((path / "state.json").read_text())
    set_rng_state(state["rng"])
    return state
