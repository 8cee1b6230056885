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


def _keyed_reference(name: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Keyed draws written out: every matrix, each part of a packed one under the unpacked model's name, one fp32
    `randn(shape) * std` from a generator seeded by `part_seed(seed, name)`, then the cast."""
    model = build_model(
        preset(name), dtype=torch.float32, seed=seed
    )  # norms, biases; matrices replaced below
    packed = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    out = {}
    for n, p in model.named_parameters():
        if n.endswith(("norm.weight", ".bias")):
            out[n] = p.detach().to(dtype)
            continue
        parts = packed[n].parts if n in packed else {"": p.shape[0]}
        pieces = []
        for part, rows in parts.items():
            key = f"{n.rsplit('.', 2)[0]}.{part}.weight" if part else n
            g = torch.Generator().manual_seed(init.part_seed(seed, key))
            pieces.append(torch.randn((rows, *p.shape[1:]), generator=g, dtype=torch.float32) * 0.02)
        out[n] = torch.cat(pieces).to(dtype)
    return out


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_keyed_draws_are_each_parts_own_draw_whatever_the_threads(name: str, monkeypatch) -> None:
    """model.init_draws = "keyed": each part from its own seeded generator, drawn on threads; the same bits with 1
    or 4 threads and with many chunks, and other values than the one stream (the control)."""
    for dtype in (torch.float32, torch.bfloat16):
        want = _keyed_reference(name, dtype, seed=3)
        for workers, chunk in ((1, 1 << 24), (4, 4096 + 16)):
            monkeypatch.setattr(init, "CHUNK", chunk)
            monkeypatch.setattr(init, "draw_workers", lambda w=workers: w)
            got = dict(build_model(preset(name), dtype=dtype, seed=3, init_draws="keyed").named_parameters())
            assert got.keys() == want.keys()
            for k in want:
                assert got[k].dtype == dtype and torch.equal(got[k], want[k]), (name, dtype, workers, k)
        # The control: the one stream gives every matrix other values.
        stream = dict(build_model(preset(name), dtype=dtype, seed=3).named_parameters())
        matrices = [k for k in want if not k.endswith(("norm.weight", ".bias"))]
        assert matrices and not any(torch.equal(stream[k], want[k]) for k in matrices)
    with pytest.raises(ValueError, match="draws must be one of"):
        build_model(preset("tiny"), init_draws="parallel")


@pytest.mark.gpu
def test_keyed_draws_on_the_gpu_are_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(init, "CHUNK", 4096)
    monkeypatch.setattr(init, "draw_workers", lambda: 4)
    for dtype in (torch.float32, torch.bfloat16):
        cpu = dict(
            build_model(preset("tiny-moe"), dtype=dtype, seed=5, init_draws="keyed").named_parameters()
        )
        gpu = build_model(preset("tiny-moe"), device="cuda", dtype=dtype, seed=5, init_draws="keyed")
        for k, p in gpu.named_parameters():
            assert p.is_cuda and torch.equal(cpu[k], p.cpu()), (dtype, k)
