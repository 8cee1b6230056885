"""Can a decode step run the invariant attention kernel with a smaller query tile, or other warps/stages, and
keep every row's bits? How fast is each?

The exact attention has ONE forward tile (ATTN_ROWS = 64 (query, q-head) rows, ATTN_BLOCK_N = 64 keys): a decode
step of qwen3-0.6b fills 2 of the 64 rows (G = 2 query heads per KV head), so a program spends its MMAs and
exp2s on padding. A 16- or 32-row tile keeps the key tiles, the in-order online softmax and each row's own MMA
chain, but the MMA instruction and the register layout of the row reductions may change with it: whether a row
gets the same bits is a property of the hardware and the compiler, measured here. For each decode geometry
(concurrency, context lengths) and each candidate (rows, block_n, num_warps, num_stages) it checks every output
row against the default tile (torch.equal) and times one call inside a CUDA graph (no host launch cost). JSON
lines on stdout.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_decode_attn.py`; with `--split`: the split-KV decode
(chunk partials + combine) against one program per (sequence, KV head) at several key-chunk sizes, and what
each chunk size costs the training forward.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from _script import parser, require_cuda  # benchmarks/: the script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_decode_gemm import _time  # noqa: E402  (GPU microseconds per call, from a CUDA graph)

from exactrl.ops.batch import AttentionBatch
from exactrl.ops.triton.attention import _FWD_LAUNCH, ATTN_BLOCK_N, ATTN_ROWS, attention_fwd


def _decode_inputs(c: int, lo: int, hi: int, hq: int = 16, hkv: int = 8, dh: int = 128, page: int = 16):
    """A decode step of c sequences with contexts in [lo, hi] over a shuffled paged cache of trained-looking
    K/V (scaled normal, a few large outliers as real keys have)."""
    rnd = random.Random(c * 7919 + lo)
    ctx = [rnd.randint(lo, hi) for _ in range(c)]
    pages = [-(-n // page) for n in ctx]
    ids = list(range(sum(pages) + 8))
    rnd.shuffle(ids)
    tables, at = [], 0
    for n in pages:
        tables.append(ids[at : at + n])
        at += n
    slots = len(ids) * page
    gen = torch.Generator(device="cuda").manual_seed(c + lo)
    k = torch.randn(slots, hkv, dh, device="cuda", generator=gen) * 0.5
    k[:, :, :4] *= 8.0  # outlier channels
    v = torch.randn(slots, hkv, dh, device="cuda", generator=gen)
    q = torch.randn(c, hq, dh, device="cuda", generator=gen) * 0.7
    batch = AttentionBatch.paged([n - 1 for n in ctx], [1] * c, tables, page, device="cuda")
    bf = torch.bfloat16
    return q.to(bf), k.to(bf), v.to(bf), batch, ctx


def kv_bytes(ctx: list[int], hkv: int = 8, dh: int = 128) -> int:
    return sum(ctx) * hkv * dh * 2 * 2


CANDIDATES = [
    (rows, ATTN_BLOCK_N, warps, stages)
    for rows in (16, 32, 64)
    for warps in (1, 2, 4, 8)
    for stages in (2, 3, 4)
    if not (rows == 16 and warps > 2) and not (rows == 32 and warps > 4)
]
GEOMETRIES = [
    (1, 128, 384),
    (16, 128, 384),
    (64, 128, 384),
    (256, 128, 384),
    (1, 1024, 2048),
    (64, 1024, 2048),
]


def probe(c: int, lo: int, hi: int) -> dict:
    """One decode geometry: the default tile's time, and every candidate's bits and time."""
    default = (ATTN_ROWS, ATTN_BLOCK_N, *_FWD_LAUNCH[torch.bfloat16])
    q, k, v, batch, ctx = _decode_inputs(c, lo, hi)
    rec: dict = {"concurrency": c, "context": [lo, hi], "kv_MB": kv_bytes(ctx) / 1e6, "default": default}
    with torch.no_grad():
        ref = attention_fwd(q, k, v, batch)[0]
        rec["us_default"] = round(_time(lambda: attention_fwd(q, k, v, batch)), 2)
        out = {}
        for cfg in CANDIDATES:
            key = "r{}n{}w{}s{}".format(*cfg)
            try:
                same = bool(torch.equal(attention_fwd(q, k, v, batch, config=cfg)[0], ref))
                us = _time(lambda cfg=cfg: attention_fwd(q, k, v, batch, config=cfg))
            except Exception as e:  # out of resources: report and go on
                out[key] = {"error": str(e)[:120]}
                continue
            out[key] = {"equal": same, "us": round(us, 2)}
    rec["candidates"] = out
    eq = {kk: vv for kk, vv in out.items() if vv.get("equal")}
    if eq:
        best = min(eq, key=lambda kk: eq[kk]["us"])
        rec["best_equal"] = best
        rec["best_equal_speedup"] = rec["us_default"] / eq[best]["us"]
    return rec


def probe_split(c: int, lo: int, hi: int) -> dict:
    """One decode geometry: one program per (sequence, KV head) against split-KV (chunk partials + combine) at
    key chunks of 64, 128, 256 and 512 positions; whether split and unsplit give the same bits at each."""
    q, k, v, batch, ctx = _decode_inputs(c, lo, hi)
    rec: dict = {"concurrency": c, "context": [lo, hi], "kv_MB": kv_bytes(ctx) / 1e6}
    with torch.no_grad():
        for keys in (64, 128, 256, 512):
            one = attention_fwd(q, k, v, batch, split=False, split_keys=keys)[0]
            two = attention_fwd(q, k, v, batch, split=True, split_keys=keys)[0]
            rec[f"S{keys}"] = {
                "equal": bool(torch.equal(one, two)),
                "us_unsplit": round(
                    _time(lambda s=keys: attention_fwd(q, k, v, batch, split=False, split_keys=s)), 2
                ),
                "us_split": round(
                    _time(lambda s=keys: attention_fwd(q, k, v, batch, split=True, split_keys=s)), 2
                ),
            }
    return rec


def probe_split_wide(c: int, lo: int, hi: int, width: int = 2560) -> dict:
    """As the engine's decode graphs see it: the slot table padded to `width` keys (max_model_len), so split-KV
    launches programs for every chunk of the width and those past a sequence's keys exit at once. Unsplit vs
    split at the fixed ATTN_SPLIT_KEYS."""
    import dataclasses

    import torch.nn.functional as F

    q, k, v, batch, ctx = _decode_inputs(c, lo, hi)
    slots = batch.key_slots
    wide = dataclasses.replace(batch, key_slots=F.pad(slots, (0, width - slots.shape[1])))
    rec: dict = {"concurrency": c, "context": [lo, hi], "width": width}
    with torch.no_grad():
        one = attention_fwd(q, k, v, wide, split=False)[0]
        two = attention_fwd(q, k, v, wide, split=True)[0]
        rec["equal"] = bool(torch.equal(one, two))
        rec["us_unsplit"] = round(_time(lambda: attention_fwd(q, k, v, wide, split=False)), 2)
        rec["us_split"] = round(_time(lambda: attention_fwd(q, k, v, wide, split=True)), 2)
    return rec


def train_fold_cost() -> list[dict]:
    """The training forward at key chunks of 64 .. 4096 positions (4096: no fold within these sequences)."""
    from exactrl.ops.batch import AttentionBatch

    out = []
    for B, L in ((8, 1024), (4, 2048)):
        gen = torch.Generator(device="cuda").manual_seed(B)
        q = torch.randn(B * L, 16, 128, device="cuda", generator=gen).to(torch.bfloat16)
        k = torch.randn(B * L, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
        v = torch.randn(B * L, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
        batch = AttentionBatch.packed([L] * B, device="cuda")
        rec = {"train": [B, L]}
        with torch.no_grad():
            for keys in (64, 128, 256, 512, 4096):
                rec[f"us_S{keys}"] = round(
                    _time(
                        lambda s=keys, x=(q, k, v, batch): attention_fwd(*x, split=False, split_keys=s),
                        reps=5,
                    ),
                    1,
                )
        out.append(rec)
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument(
        "--split", action="store_true", help="split-KV decode against one program per (sequence, KV head)"
    )
    ap.add_argument("--wide", action="store_true", help="split-KV decode at wider concurrencies and contexts")
    args = ap.parse_args()
    require_cuda("probe_decode_attn.py")
    if args.wide:
        for c in (16, 32, 48, 64, 128, 256):
            for lo, hi in ((128, 384), (384, 1024), (1024, 2048)):
                print(json.dumps(probe_split_wide(c, lo, hi)), flush=True)
        return
    if args.split:
        for rec in train_fold_cost():
            print(json.dumps(rec), flush=True)
        for c, lo, hi in GEOMETRIES:
            print(json.dumps(probe_split(c, lo, hi)), flush=True)
        return
    for c, lo, hi in GEOMETRIES:
        print(json.dumps(probe(c, lo, hi)), flush=True)


if __name__ == "__main__":
    main()
