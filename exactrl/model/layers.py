"""The decoder's building blocks that hold weights: RMSNorm, the projections (`Linear`, `PackedLinear` with the
state-dict hooks that give a packed weight its HF part names) and the SiLU-gated MLP. The arithmetic is the ops
backend's; these modules only own parameters and say which op runs on them."""

from __future__ import annotations

import torch
from torch import nn

from exactrl.model.config import ModelConfig
from exactrl.ops import Ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Linear(nn.Module):
    """Holds a weight (and bias), and optionally a LoRA adapter (`exactrl.model.lora`); the arithmetic is the ops
    backend's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.lora: nn.Module | None = None  # a LoRA module (exactrl/model/lora.py) once `add_lora` targets it

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]: the base product, then the adapter's low-rank term added (when enabled)."""
        y = ops.linear(x, self.weight, self.bias)
        if self.lora is not None and self.lora.enabled:
            (y,) = self.lora(ops, x, (y,))
        return y


class PackedLinear(Linear):
    """Projections of one input stacked into one weight: `parts` names each part (its HF module name, in row
    order) and its output width. The parent module registers `pack_state_dict` so its state dict holds the
    parts under their own names."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(parts.values()), bias)
        self.parts = dict(parts)

    def forward(self, ops: Ops, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, in] -> one [T, out] output per part, in order (`Ops.packed_linear`), each with its part's
        adapter term added (when enabled)."""
        outs = ops.packed_linear(x, self.weight, self.bias, list(self.parts.values()))
        if self.lora is not None and self.lora.enabled:
            outs = self.lora(ops, x, outs)
        return outs


def pack_state_dict(parent: nn.Module, packed_name: str) -> None:
    """Make `parent`'s state dict name `parent.<packed_name>` by its parts (HF's names): split on `state_dict()`
    (views of the packed tensor, no copy), concatenated on `load_state_dict()`."""
    packed: PackedLinear = getattr(parent, packed_name)

    def split_on_save(module, state_dict, prefix, local_metadata) -> None:
        for kind in ("weight", "bias"):
            t = state_dict.pop(f"{prefix}{packed_name}.{kind}", None)
            if t is None:
                continue
            for part, piece in zip(packed.parts, t.split(list(packed.parts.values()), dim=0)):
                state_dict[f"{prefix}{part}.{kind}"] = piece

    def pack_on_load(
        module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        for kind in ("weight", "bias"):
            names = [f"{prefix}{part}.{kind}" for part in packed.parts]
            present = [n for n in names if n in state_dict]
            if not present:
                continue
            if len(present) < len(names):  # leave them for load_state_dict to report as missing / unexpected
                missing_keys.extend(n for n in names if n not in state_dict)
                continue
            pieces = [state_dict.pop(n) for n in names]
            rest = tuple(getattr(packed, kind).shape[1:])  # (in_features,) for the weight, () for the bias
            bad = [
                f"{n}: shape {tuple(t.shape)}, the model needs {(rows, *rest)}"
                for n, t, rows in zip(names, pieces, packed.parts.values())
                if tuple(t.shape) != (rows, *rest)
            ]
            if bad:  # the packed entry stays missing: load_state_dict reports both
                errors.extend(bad)
                continue
            state_dict[f"{prefix}{packed_name}.{kind}"] = torch.cat(pieces, dim=0)

    parent.register_state_dict_post_hook(split_on_save)
    parent.register_load_state_dict_pre_hook(pack_on_load)


class MLP(nn.Module):
    """The SiLU-gated MLP: down(silu(gate(x)) * up(x)); `intermediate_size` overrides the config's width (a
    Qwen2-MoE shared expert is this MLP at its own width)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = PackedLinear(
            cfg.hidden_size, {"gate_proj": inter, "up_proj": inter}, cfg.mlp_bias
        )
        self.down_proj = Linear(inter, cfg.hidden_size, cfg.mlp_bias)
        pack_state_dict(self, "gate_up_proj")

    def forward(self, ops: Ops, x):
        gate, up = self.gate_up_proj(ops, x)
        h = ops.silu_mul(gate, up)
        return self.down_proj(ops, h)
