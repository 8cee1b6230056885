"""Every op on the model's forward path goes through the ops interface (DESIGN rule 9): while the engine samples and
the trainer scores, no torch function runs between the ops calls except moving data around and IEEE-exact
elementwise arithmetic (`+ - * /`: correctly rounded in scalar and vector code alike, so a row's bits cannot
depend on the call). Anything else there (a transcendental, a reduction, a matmul) would escape the backends'
invariance rules: the Qwen2-MoE shared-expert gate's direct `torch.sigmoid` was exactly that, and this check names
it (`test_a_bypass_is_named` plants it back)."""

from __future__ import annotations

import collections

import torch
from preset_shapes import small_shape, trained_looking
from torch.overrides import TorchFunctionMode

from exactrl.model.config import PRESETS
from exactrl.model.lora import LoraSpec, add_lora
from exactrl.parity import ParityResult, run_parity

# Torch functions allowed between ops calls on the forward path: views and indexing, the embedding lookup (a
# gather), dtype casts (a cast rounds each element on its own), and the correctly rounded arithmetic.
ALLOWED = {
    "__get__", "__getitem__", "dim", "size", "view", "reshape", "contiguous", "split", "unbind", "cat", "stack",
    "embedding", "to", "float", "type",
    "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "mul", "__mul__", "__rmul__",
    "div", "__truediv__", "__rdiv__", "__rtruediv__", "neg", "__neg__",
}  # fmt: skip


class _WatchedOps:
    """The model's ops, counting how deep inside an ops call we are."""

    def __init__(self, ops) -> None:
        self._ops, self.depth = ops, 0

    def __getattr__(self, name: str):
        attr = getattr(self._ops, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.depth += 1
            try:
                return attr(*args, **kwargs)
            finally:
                self.depth -= 1

        return call


class _Bypasses(TorchFunctionMode):
    """Records torch functions called inside the model's forward/logprobs/logits but outside any ops call."""

    def __init__(self, ops: _WatchedOps) -> None:
        super().__init__()
        self.ops, self.in_model, self.seen = ops, 0, collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.in_model and not self.ops.depth:
            name = getattr(func, "__name__", str(func))
            if name not in ALLOWED:
                self.seen[name] += 1
        return func(*args, **(kwargs or {}))


def parity_with_bypasses(model, **parity_kwargs) -> tuple[collections.Counter, ParityResult]:
    """Run parity (engine prefill, decode, preemption; the trainer's packed scoring) on `model` and return the
    torch functions its forward path called past the ops interface, with parity's result."""
    watched = _WatchedOps(model.ops)
    model.ops = watched
    mode = _Bypasses(watched)

    def scoped(fn, counted: bool):
        def run(*args, **kwargs):
            before = mode.in_model
            mode.in_model = mode.in_model + 1 if counted else 0
            try:
                return fn(*args, **kwargs)
            finally:
                mode.in_model = before

        return run

    for name in ("forward", "logprobs", "logits"):
        setattr(model, name, scoped(getattr(model, name), True))
    # The RoPE table is built once per device in float64 (never per batch): not part of a step's arithmetic.
    model.rope_table = scoped(model.rope_table, False)
    with mode:
        result = run_parity(
            model, **{"num_prompts": 2, "max_tokens": 4, "samples_per_prompt": 2, **parity_kwargs}
        )
    return mode.seen, result


def bypasses(model) -> collections.Counter:
    return parity_with_bypasses(model)[0]


# Every preset's forward is checked by tests/model/test_preset_parity.py (its float32 runs go through
# `parity_with_bypasses`); here the LoRA path and the check's own negative control.


def test_lora_forward_stays_inside_the_ops() -> None:
    model = trained_looking(small_shape(PRESETS["tiny"]), torch.float32)
    add_lora(model, LoraSpec(rank=4, alpha=8.0))
    assert bypasses(model) == {}


def test_a_bypass_is_named(monkeypatch) -> None:
    """Plant: the shared-expert gate's sigmoid called directly, as it was."""
    from exactrl.model import moe

    def direct(self, ops, x):
        return torch.sigmoid(self.shared_expert_gate(ops, x)) * self.shared_expert(ops, x)

    model = trained_looking(small_shape(PRESETS["tiny-qwen2-moe"]), torch.float32)
    real_forward = moe.SparseMoeBlock.forward

    def planted(self, ops, x):
        out = real_forward(self, ops, x)
        return out + 0 * direct(self, ops, x)

    monkeypatch.setattr(moe.SparseMoeBlock, "forward", planted)
    assert "sigmoid" in bypasses(model)
