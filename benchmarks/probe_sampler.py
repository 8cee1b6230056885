"""How many programs per SM should the Gumbel-max sampler aim for? (exactrl/ops/triton/sampling.py
`_PROGRAMS_PER_SM`, which decides how many vocabulary slices a row is cut into.)

For a decode step's rows (1, 16, 64, 256) of bf16 raw logits over qwen3's vocabulary, with the temperature inside
the kernel (the form the decode graphs use), it times one call per setting inside a CUDA graph and checks that
every setting draws the same tokens (the split never changes the token). A table line and a JSON line per row
count on stdout.

Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_sampler.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _script import kernel_device, parser  # benchmarks/: the script's own folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_decode_gemm import _time  # noqa: E402  (GPU microseconds per call, from a CUDA graph)

from exactrl.ops.triton import sampling


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size (qwen3's by default)")
    ap.add_argument("--rows", default="1,16,64,256", help="comma-separated row counts (a decode step's)")
    args = ap.parse_args()
    dev = kernel_device("probe_sampler.py")
    vocab = args.vocab
    gen = torch.Generator(device=dev).manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        logits = (torch.randn(rows, vocab, device=dev, generator=gen) * 3).to(torch.bfloat16)
        parts = torch.stack(
            [
                torch.full((rows,), 1234, device=dev),
                torch.arange(rows, device=dev),
                torch.zeros(rows, dtype=torch.int64, device=dev),
                torch.full((rows,), 77, device=dev),
            ]
        )
        rec: dict = {"rows": rows, "vocab": vocab, "us": {}}
        ref = None
        for pps in (2, 4, 8, 16):
            sampling._PROGRAMS_PER_SM = pps
            fn = lambda x=logits, p=parts: sampling.gumbel_argmax(x, None, key_parts=p, temperature=0.7)  # noqa: E731
            tok = fn()
            ref = tok if ref is None else ref
            rec["us"][pps] = round(_time(fn), 1)
            rec.setdefault("same_tokens", True)
            rec["same_tokens"] &= bool(torch.equal(tok, ref))
        cells = "  ".join(f"{pps}/SM {us:7.1f}" for pps, us in rec["us"].items())
        print(f"rows {rows:4d}  us per call: {cells}  same tokens: {rec['same_tokens']}", flush=True)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
