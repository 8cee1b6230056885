"""What do the logprob kernel's vocabulary chunks cost and save? (exactrl/ops/triton/logprobs.py:
LOGPROB_SPLIT_COLS, the split form, `_split_form`.)

For 1, 16, 64, 256 and 8,192 rows (a decode step's sizes and a training microbatch's) of bf16 raw logits over
qwen3's vocabulary, temperature inside the kernel, it times one `logprobs_from_logits` call inside a CUDA graph in
both launch forms (unsplit: a program per row walking the chunks; split: a program per (row, chunk) and the
combine kernel) for several chunk sizes, and checks that the two forms give equal logprobs and entropies
(torch.equal) at each chunk size. The chunk that covers the whole vocabulary is the kernel before the chunks
(one per-lane chain over every slice, one lane reduction): its unsplit time is the baseline that the chunk fold's
training cost is measured against. `auto` is what `split=None` picks at the module's chunk. Achieved bandwidth
reads the logits once. A table line and a JSON line per row count on stdout.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_logprob_split.py [--rows 1,16,64,256,8192]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from _script import kernel_device  # benchmarks/: the script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_decode_gemm import _time  # noqa: E402  (GPU microseconds per call, from a CUDA graph)

from exactrl.ops.triton import logprobs as lpm  # noqa: E402

VOCAB = 151936
TEMPERATURE = 0.7


def _logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    # Trained-looking raw logits: std ~2.5 over the bulk, a few tokens ~20 above it.
    x = torch.randn(rows, vocab, device=gen.device, generator=gen) * 2.5
    hot = torch.randint(0, vocab, (8,), device=gen.device, generator=gen)
    x[:, hot] += 20.0
    return x.to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,64,256,8192", help="comma-separated row counts")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (qwen3's by default)")
    ap.add_argument(
        "--chunks", default="4096,8192,16384,32768", help="comma-separated column chunks (the module's added)"
    )
    args = ap.parse_args()
    dev = kernel_device("probe_logprob_split.py")
    vocab = args.vocab
    whole = triton.cdiv(vocab, lpm._BLOCK_V) * lpm._BLOCK_V  # one chunk: the single chain of old
    chunks = sorted({*(int(c) for c in args.chunks.split(",")), lpm.LOGPROB_SPLIT_COLS} - {whole}) + [whole]
    chunks = [c for c in chunks if c <= whole]
    gen = torch.Generator(device=dev).manual_seed(0)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}, vocab {vocab}, module chunk {lpm.LOGPROB_SPLIT_COLS}", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        logits = _logits(rows, vocab, gen)
        targets = torch.randint(0, vocab, (rows,), device=dev, generator=gen)
        rec: dict = {
            "rows": rows,
            "vocab": vocab,
            "module_chunk": lpm.LOGPROB_SPLIT_COLS,
            "auto_split": lpm._split_form(triton.cdiv(vocab, lpm.LOGPROB_SPLIT_COLS)),
            "us": {},
            "equal": {},
        }
        for chunk in chunks:
            label = "whole" if chunk == whole else str(chunk)
            cell = {}
            outs = {}
            for split in (False, True) if chunk < whole else (False,):

                def fn(x=logits, t=targets, split=split, chunk=chunk):
                    return lpm.logprobs_from_logits(x, t, TEMPERATURE, split, split_cols=chunk)

                outs[split] = fn()
                cell["split" if split else "unsplit"] = round(_time(fn), 1)
            if True in outs:
                rec["equal"][label] = bool(
                    torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
                )
            rec["us"][label] = cell
        best = min(v for cell in rec["us"].values() for v in cell.values())
        rec["best_GBps"] = round(logits.numel() * logits.element_size() / (best * 1e-6) / 1e9, 1)
        cells = "  ".join(
            f"{k}: " + "/".join(f"{v:.1f}" for v in cell.values()) for k, cell in rec["us"].items()
        )
        print(f"rows {rows:5d}  us (unsplit/split) per chunk  {cells}  equal: {rec['equal']}", flush=True)
        print(json.dumps(rec), flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
