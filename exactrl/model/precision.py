"""`model.precision` applied to a built model: which of a CausalLM's weights run the fp8 recipe of
`exactrl.ops.fp8` (every attention, MLP and expert projection; not the LM head, the embedding, the norms or the
router). Here, a level above the ops, because choosing the weights needs the model's modules."""

from __future__ import annotations

from exactrl.model.layers import Linear, PackedLinear
from exactrl.model.moe import Experts, SparseMoeBlock
from exactrl.model.qwen import CausalLM
from exactrl.ops.fp8 import PRECISIONS, Fp8Ops, check_fp8_device


def use_fp8(model: CausalLM) -> Fp8Ops:
    """Switch `model` (a CausalLM) to fp8 projections: wrap its ops in `Fp8Ops` and register every attention,
    MLP and expert weight (not the LM head, the embedding, the norms or the router), quantized now."""
    check_fp8_device(model.device)
    ops = model.ops if isinstance(model.ops, Fp8Ops) else Fp8Ops(model.ops)
    # Routing stays in the model dtype: the router and Qwen2-MoE's shared-expert gate, with the LM head.
    keep = {id(getattr(model, "lm_head", None))}
    for mod in model.modules():
        if isinstance(mod, SparseMoeBlock):
            keep |= {id(mod.gate), id(getattr(mod, "shared_expert_gate", None))}
    for mod in model.modules():
        if isinstance(mod, Experts):
            inter = mod.gate_up.shape[1] // 2
            ops.register(mod.gate_up, [inter, inter])
            ops.register(mod.down)
        elif isinstance(mod, Linear) and id(mod) not in keep:
            ops.register(mod.weight, list(mod.parts.values()) if isinstance(mod, PackedLinear) else None)
    model.set_ops(ops)
    return ops


def apply_precision(model: CausalLM, precision: str) -> CausalLM:
    """`model.precision` applied to a built model: "dtype" (every projection in the model dtype, as always) leaves
    it as it is; "fp8" switches its projections to fp8 (`use_fp8`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"model.precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8":
        use_fp8(model)
    return model
