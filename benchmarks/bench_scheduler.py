"""Host time of the rollout engine's scheduling per decode step, without a model (CPU only).

C sequences of P prompt tokens generate N tokens each through the real Scheduler and BlockManager, with fixed
fake tokens in place of a model; per decode step it times `schedule()`, the decode rows the engine builds
(`sample_rows()` and one `DecodeRow` per row), and `postprocess()`. On a GPU this host work runs between two
decode steps while the device idles, so it adds to every step's wall time.

Usage: python benchmarks/bench_scheduler.py [--concurrency 256] [--prompt-len 128] [--max-tokens 256] [--repeat 3]
Prints a table and one JSON line (the best of --repeat runs per phase).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from exactrl.engine.block_manager import BlockManager
from exactrl.engine.runner import DecodeRow
from exactrl.engine.scheduler import Scheduler
from exactrl.engine.sequence import Sequence


def run_once(C: int, P: int, N: int, seed: int = 0) -> dict[str, float]:
    bm = BlockManager(C * (-(-(P + N) // 16) + 1) + 16, 16, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=C, max_num_batched_tokens=8192, prefill_chunk_size=8192)
    rnd = random.Random(seed)
    for i in range(C):
        prompt = [rnd.randrange(1000) for _ in range(P)]
        sched.add(Sequence(sched.new_seq_id(), i, prompt, max_tokens=N, stop_token_ids=[]))
    totals = {"schedule": 0.0, "rows": 0.0, "postprocess": 0.0}
    steps = 0
    while sched.has_unfinished():
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        rows = batch.sample_rows()
        drows = [  # what the engine builds for a decode step
            DecodeRow(e.seq.token_ids[e.start], e.start, e.block_table, seed, r.request_id, r.sample_index)
            for e, r in zip(batch.entries, rows)
        ]
        t2 = time.perf_counter()
        sched.postprocess(batch, [7] * len(rows), [0.0] * len(drows))
        t3 = time.perf_counter()
        if all(e.is_decode for e in batch.entries):
            totals["schedule"] += t1 - t0
            totals["rows"] += t2 - t1
            totals["postprocess"] += t3 - t2
            steps += 1
    return {k: v / steps * 1e3 for k, v in totals.items()} | {"decode_steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    runs = [run_once(args.concurrency, args.prompt_len, args.max_tokens) for _ in range(args.repeat)]
    best = {k: min(r[k] for r in runs) for k in ("schedule", "rows", "postprocess")}
    best["total"] = sum(best.values())
    print(f"{'phase':<12} ms per decode step (best of {args.repeat}, {args.concurrency} sequences)")
    for k, v in best.items():
        print(f"{k:<12} {v:8.3f}")
    print(json.dumps({"bench": "scheduler_host", "concurrency": args.concurrency, "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, **{f"{k}_ms": v for k, v in best.items()}}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
