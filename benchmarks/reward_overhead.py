"""Per-call cost of the reward worker processes, at the quickstart's batch (768 completions of arithmetic).

Scores the same batch with the built-in `numeric_match` (runs in this process) and with a user-file reward that
calls it (runs in the worker processes), and prints a table and a JSON line.

    python benchmarks/reward_overhead.py [--rollouts 768] [--repeats 5] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from exactrl.tasks import Example, RewardComputer

PLUGIN = "from exactrl.tasks.rewards import numeric_match\n\ndef user_numeric(c, a, e):\n    return numeric_match(c, a, e)\n"
BATCHED = (
    "from exactrl.tasks.rewards import numeric_match\n\ndef user_batched(cs, as_, es):\n"
    "    return [numeric_match(c, a, e) for c, a, e in zip(cs, as_, es)]\nuser_batched.batched = True\n"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=768)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, default=None)
    args = p.parse_args()
    rng = random.Random(0)
    n = args.rollouts
    answers = [str(rng.randint(-9, 27)) for _ in range(n)]
    completions = [a if rng.random() < 0.5 else str(rng.randint(-9, 27)) for a in answers]
    examples = [
        Example(prompt=f"{rng.randint(0, 9)}+{rng.randint(0, 9)}-{rng.randint(0, 9)}=", answer=a)
        for a in answers
    ]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "user_rewards.py").write_text(PLUGIN)
        (Path(d) / "user_batched.py").write_text(BATCHED)
        for label, spec in [
            ("built-in, in process", "numeric_match"),
            ("user file, worker per call", "user_rewards.py:user_numeric"),
            ("user file, batched", "user_batched.py:user_batched"),
        ]:
            t0 = time.perf_counter()
            rc = RewardComputer([spec], base_dir=d, max_workers=args.workers)
            start_s = time.perf_counter() - t0
            rc(completions, answers, examples)  # warm: every worker started
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                res = rc(completions, answers, examples)
                times.append(time.perf_counter() - t0)
            rc.close()
            best = min(times)
            rows.append(
                {
                    "reward": label,
                    "batch_ms": 1e3 * best,
                    "per_call_us": 1e6 * best / n,
                    "start_s": start_s,
                    "mean_reward": sum(res.rewards) / n,
                }
            )
    print(f"{'reward':30s} {'batch ms':>9s} {'us/call':>8s} {'start s':>8s}")
    for r in rows:
        print(f"{r['reward']:30s} {r['batch_ms']:9.1f} {r['per_call_us']:8.1f} {r['start_s']:8.2f}")
    print(json.dumps({"benchmark": "reward_overhead", "rollouts": n, "rows": rows}))


if __name__ == "__main__":
    main()
