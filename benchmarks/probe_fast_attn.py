"""Probe what this torch build offers for a fast (non-invariant) attention path on CUDA: varlen flash attention
(forward, backward, paged KV through block_table at several page sizes, seqused_k) and its speed, printed as
lines of JSON. Run on the GPU: `PYTHONPATH=. python3 benchmarks/probe_fast_attn.py`."""

from __future__ import annotations

import inspect
import json
import time

import torch
from _script import parser, require_cuda  # benchmarks/: the script's own folder is on sys.path


def main() -> None:
    parser(__doc__).parse_args()
    require_cuda("probe_fast_attn.py")
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda}))
    from torch.nn.attention import varlen

    print(json.dumps({"varlen_signature": str(inspect.signature(varlen.varlen_attn))}))
    params = inspect.signature(varlen.varlen_attn).parameters
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}  # older builds take GQA without the flag
    dev, dt = "cuda", torch.bfloat16
    hq, hkv, dh = 16, 8, 128
    lens = [300, 17, 1024, 511]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device=dev, dtype=torch.int32)
    T = sum(lens)
    q = torch.randn(T, hq, dh, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(T, hkv, dh, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(T, hkv, dh, device=dev, dtype=dt, requires_grad=True)
    res = {}
    try:
        o = varlen.varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=(-1, 0), **gqa)
        o.float().sum().backward()
        res["fwd_bwd"] = "ok"
        # reference for one sequence
        s0 = lens[0]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:s0].transpose(0, 1)[None],
            k[:s0].transpose(0, 1)[None],
            v[:s0].transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )[0].transpose(0, 1)
        res["max_diff_vs_sdpa"] = (o[:s0].float() - ref.float()).abs().max().item()
    except Exception as e:  # noqa: BLE001
        res["fwd_bwd"] = f"{type(e).__name__}: {e}"[:400]
    print(json.dumps(res))
    for page in (16, 64, 256):
        r = {"page": page}
        if "block_table" not in params:
            r["error"] = "this torch build's varlen_attn takes no block_table (no paged KV)"
            print(json.dumps(r))
            continue
        try:
            nblk = 512
            kc = torch.randn(nblk, page, hkv, dh, device=dev, dtype=dt)
            vc = torch.randn(nblk, page, hkv, dh, device=dev, dtype=dt)
            B = 64
            klen = torch.randint(100, 900, (B,), device=dev, dtype=torch.int32)
            maxb = -(-900 // page)
            bt = torch.randint(0, nblk, (B, maxb), device=dev, dtype=torch.int32)
            qd = torch.randn(B, hq, dh, device=dev, dtype=dt)
            cuq = torch.arange(B + 1, device=dev, dtype=torch.int32)
            cuk = torch.zeros(B + 1, device=dev, dtype=torch.int32)
            cuk[1:] = klen.cumsum(0)
            kwargs = dict(window_size=(-1, 0), seqused_k=klen, block_table=bt, **gqa)
            o = varlen.varlen_attn(qd, kc, vc, cuq, cuk, 1, maxb * page, **kwargs)
            # check one row against a gather
            b = 3
            n = int(klen[b])
            slots = (bt[b].long()[:, None] * page + torch.arange(page, device=dev)).reshape(-1)[:n]
            kk = kc.view(-1, hkv, dh)[slots]
            vv = vc.view(-1, hkv, dh)[slots]
            ref = torch.nn.functional.scaled_dot_product_attention(
                qd[b][None, :, None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], enable_gqa=True
            )[0, :, 0]
            r["max_diff"] = (o[b].float() - ref.float()).abs().max().item()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                varlen.varlen_attn(qd, kc, vc, cuq, cuk, 1, maxb * page, **kwargs)
            torch.cuda.synchronize()
            r["ms"] = (time.perf_counter() - t) / 50 * 1e3
            # graph capture
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                varlen.varlen_attn(qd, kc, vc, cuq, cuk, 1, maxb * page, **kwargs)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                og = varlen.varlen_attn(qd, kc, vc, cuq, cuk, 1, maxb * page, **kwargs)
            g.replay()
            torch.cuda.synchronize()
            r["graph"] = bool(torch.equal(og, o))
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {e}"[:400]
        print(json.dumps(r))
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        print(json.dumps({"flex_attention": "importable"}))
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"flex_attention": str(e)[:200]}))


if __name__ == "__main__":
    main()
