"""Every shipped preset, in float32 and bfloat16, is exact on the CPU: `run_parity` (the engine's recorded logprobs
against the trainer's packed forward, under four batch compositions, preemption, forks and prefix hits) at a small
shape that keeps each preset's architecture (bias, q/k norm, tied head, RoPE scaling, GQA ratio, experts, the
shared expert and its sigmoid gate, dense/sparse layer mix).

This is the test that would have caught the Qwen2-MoE shared-expert gate calling `torch.sigmoid` past the ops
interface: bf16 hid it, fp32 parity of `tiny-qwen2-moe` failed on 332 of 4,608 tokens. The float32 runs also
check that no torch function on the forward path bypasses the ops interface (tests/model/test_ops_boundary.py). The shrunk widths are not
multiples of 16 on purpose, so elementwise ops see tensors with ragged tails."""

from __future__ import annotations

import pytest
import torch
from preset_shapes import small_shape, trained_looking
from test_ops_boundary import parity_with_bypasses

from exactrl.model.config import PRESETS
from exactrl.model.qwen import build_model
from exactrl.parity import run_parity

# One preset per architecture (the module code a forward runs): the ops-boundary watch is slow, and the other
# presets run the same modules with other sizes.
ARCHITECTURES = {"tiny", "tiny-llama", "tiny-moe", "tiny-qwen2-moe", "qwen2.5-0.5b"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "name",
    # The other presets run the same modules at other sizes: `make test-all` runs them too.
    [n if n in ARCHITECTURES else pytest.param(n, marks=pytest.mark.extended) for n in PRESETS],
)
def test_every_preset_is_exact_on_the_cpu(name: str, dtype: torch.dtype) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(
        2
    )  # the thread split is where a kernel's tail routine shows; pytest-xdist gives one
    try:
        model = trained_looking(small_shape(PRESETS[name]), dtype)
        kwargs = dict(num_prompts=4, max_tokens=10, samples_per_prompt=3)
        if dtype == torch.float32 and name in ARCHITECTURES:
            # and no op of its forward path bypasses the ops interface (DESIGN rule 9)
            seen, res = parity_with_bypasses(model, **kwargs)
            assert seen == {}, f"{name}: torch functions called past the ops interface: {dict(seen)}"
        else:
            res = run_parity(model, **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert res.num_tokens > 100
    assert res.tokens_identical_across_compositions, f"{name} {dtype}: sampled tokens depend on the batch"
    assert res.num_mismatched == 0, (
        f"{name} {dtype}: {res.num_mismatched} of {res.num_tokens} rollout logprobs differ from the trainer's "
        f"(max |diff| {res.max_abs_diff:.3g})"
    )


def test_the_preset_sweep_can_fail() -> None:
    """Negative control: the same check with PyTorch's default kernels (unpadded GEMMs, SDPA) finds mismatches on
    the Qwen2-MoE shape, so a green sweep means something."""
    cfg = small_shape(PRESETS["tiny-qwen2-moe"])
    model = trained_looking(cfg, torch.float32)
    fast = build_model(cfg, device="cpu", dtype=torch.float32, exact=False)
    fast.load_state_dict(model.state_dict())
    res = run_parity(fast, num_prompts=4, max_tokens=10, samples_per_prompt=3)
    assert res.num_mismatched > 0
