"""Random weights drawn in place (exactrl/model/init.py): the bits of one fp32 `randn(shape) * std` per tensor,
cast to the parameter's dtype, whatever the chunking, the dtype and the device."""

from __future__ import annotations

import pytest
import torch

import exactrl.model.init as init
from exactrl.model import build_model, preset
from exactrl.model.init import chunk_bounds, normal_into
from exactrl.model.layers import PackedLinear
from exactrl.model.qwen import CausalLM
from exactrl.ops import get_ops

SIZES = [1, 7, 15, 16, 17, 31, 32, 33, 47, 64, 65, 100, 1000, 4099]


def _reference(shape: tuple[int, ...], seed: int, std: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw of the whole tensor (what the init did before drawing in chunks), and the generator after it."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32) * std, g.get_state()


@pytest.mark.parametrize("chunk", [16, 32, 48, 1 << 24])
def test_chunked_draws_are_the_whole_draw(chunk: int) -> None:
    for n in SIZES:
        want, state = _reference((n,), seed=n)
        for dtype in (torch.float32, torch.bfloat16):
            got = torch.empty(n, dtype=dtype)
            g = torch.Generator().manual_seed(n)
            seen: list[int] = []
            normal_into(got, 0.02, g, seen.append, chunk=chunk)
            assert torch.equal(got, want.to(dtype)), (n, dtype, chunk)
            assert torch.equal(g.get_state(), state)  # the next tensor's draws start where they did
            assert sum(seen) == n


def test_chunk_bounds_keep_16_or_more_in_the_last_draw() -> None:
    assert chunk_bounds(0, 16) == []
    assert chunk_bounds(7, 16) == [(0, 7)]
    assert chunk_bounds(40, 16) == [(0, 16), (16, 40)]  # 8 left over: joins the draw before it
    assert chunk_bounds(48, 16) == [(0, 16), (16, 32), (32, 48)]
    with pytest.raises(ValueError, match="multiple of 16"):
        chunk_bounds(100, 24)


def test_a_last_draw_of_fewer_than_16_would_differ() -> None:
    """Negative control: the rule the bounds follow is needed. 40 drawn as 32 + 8 gives other values than one
    draw (torch draws fewer than 16 elements another way)."""
    want, _ = _reference((40,), seed=1, std=1.0)
    g = torch.Generator().manual_seed(1)
    got = torch.empty(40)
    got[:32].normal_(generator=g)
    got[32:].normal_(generator=g)
    assert not torch.equal(got, want)


def _old_build(name: str, dtype: torch.dtype, seed: int) -> CausalLM:
    """build_model as it was: the whole model in fp32 on the CPU, a randn per tensor part, then the cast."""
    with torch.device("meta"):
        model = CausalLM(preset(name), ops=get_ops("cpu", True))
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    packed = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            elif n.endswith(".bias"):
                p.zero_()
            else:
                rows = list(packed[n].parts.values()) if n in packed else [p.shape[0]]
                for piece in p.split(rows, dim=0):
                    piece.copy_(torch.randn(piece.shape, generator=g, dtype=torch.float32) * 0.02)
    return model.to(dtype=dtype)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "tiny-moe", "tiny-qwen2-moe"])
def test_built_models_keep_their_values(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The presets' random weights are what they were (checkpoints, replays and twin runs of a preset rely on
    them), also when every tensor is drawn in many chunks."""
    for chunk in (1 << 24, 4096 + 16):
        monkeypatch.setattr(init, "CHUNK", chunk)
        for dtype in (torch.float32, torch.bfloat16):
            old = dict(_old_build(name, dtype, seed=3).named_parameters())
            new = dict(build_model(preset(name), dtype=dtype, seed=3).named_parameters())
            assert old.keys() == new.keys()
            for k in old:
                assert new[k].dtype == dtype and torch.equal(old[k], new[k]), (name, dtype, chunk, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_model_built_on_the_gpu_has_the_cpus_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the chunks are scaled and cast there (pinned buffers taking turns): the same bits."""
    monkeypatch.setattr(init, "CHUNK", 4096)  # many chunks, both buffers reused
    for name in ("tiny", "tiny-moe"):
        for dtype in (torch.float32, torch.bfloat16):
            cpu = dict(build_model(preset(name), dtype=dtype, seed=5).named_parameters())
            gpu = dict(build_model(preset(name), device="cuda", dtype=dtype, seed=5).named_parameters())
            for k in cpu:
                assert gpu[k].is_cuda and torch.equal(cpu[k], gpu[k].cpu()), (name, dtype, k)
