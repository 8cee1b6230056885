"""The row-invariance probe of the RMSNorm kernels, shared by the interpreter and the GPU test files."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def norm_row_failures(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    inputs: list[torch.Tensor],
    *,
    randn: Callable[..., torch.Tensor],
    prefixes: Callable[[int, int], Iterable[int]],
    window: int,
    last_after: Callable[[int], int],
    seed: int = 0,
) -> list[str]:
    """Where `fn` (rows -> a tuple of row outputs) gives some row other bits than it has in `fn(*inputs)`: the row
    alone, in m-row prefixes (m from `prefixes(rows, R)`, rows = the kernel's row tile), in `window`-row windows at
    offsets that are no multiple of the tile, and inside bigger calls with random rows (from `randn`) before and
    after it, so it sits at another place in another tile (the last of them with `last_after(rows)` rows after).
    Empty: invariant."""
    from exactrl.ops.triton.norm import norm_config  # after the test file set TRITON_INTERPRET

    full = fn(*inputs)
    R, D = inputs[0].shape
    rows = norm_config(D)[1]
    bad = []

    def check(name, part, lo):
        if not all(torch.equal(p, f[lo : lo + p.shape[0]]) for p, f in zip(part, full)):
            bad.append(name)

    for i in sorted({0, 1, rows - 1, rows, R // 2, R - 1}):
        check(f"row {i} alone", fn(*(t[i : i + 1] for t in inputs)), i)
    for m in prefixes(rows, R):
        check(f"{m}-row prefix", fn(*(t[:m] for t in inputs)), 0)
    for off in (1, rows // 2 + 3, R - window):
        check(f"{window} rows at {off}", fn(*(t[off : off + window] for t in inputs)), off)
    for before, after in ((1, 0), (rows - 1, 5), (3 * rows + 5, last_after(rows))):
        pads = [
            (
                randn(before, D, dtype=t.dtype, seed=seed + 2 * j),
                randn(after, D, dtype=t.dtype, seed=seed + 2 * j + 1),
            )
            for j, t in enumerate(inputs)
        ]
        big = fn(*(torch.cat((a, t, b)) for t, (a, b) in zip(inputs, pads)))
        if not all(torch.equal(o[before : before + R], f) for o, f in zip(big, full)):
            bad.append(f"inside a call of {before} + {R} + {after} rows")
    return bad
