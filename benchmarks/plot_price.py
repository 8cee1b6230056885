"""The price of exactness from one device call's `bench rollout` / `bench train` JSON lines: a markdown table
(exact / fast per concurrency and per training shape) and a PNG of rollout tokens/s vs concurrency.

Usage: python benchmarks/plot_price.py ROLLOUT.jsonl [TRAIN.jsonl] --png OUT.png
(`bash benchmarks/gpu.sh price` writes the rollout file under $OUT: price-rollout.jsonl, and draws it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _lines(path: str | None) -> list[dict]:
    if not path:
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith("{")]


def rollout_table(rows: list[dict]) -> tuple[str, dict[str, dict[int, float]]]:
    by: dict[str, dict[int, dict]] = {}
    for r in rows:
        by.setdefault(r["mode"], {})[int(r["concurrency"])] = r
    out = [
        "| concurrency | exact tok/s | fast tok/s | exact / fast | decode roofline fraction exact / fast |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in sorted(set(by.get("exact", {})) & set(by.get("fast", {}))):
        e, f = by["exact"][c], by["fast"][c]
        out.append(
            f"| {c} | {e['tokens_per_s']:,.0f} | {f['tokens_per_s']:,.0f} | "
            f"**{e['tokens_per_s'] / f['tokens_per_s']:.2f}** | "
            f"{e['decode_roofline_fraction']:.2f} / {f['decode_roofline_fraction']:.2f} |"
        )
    series = {m: {c: r["tokens_per_s"] for c, r in d.items()} for m, d in by.items()}
    return "\n".join(out), series


def train_table(rows: list[dict]) -> str:
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(r["preset"], {})[r["mode"]] = r
    out = [
        "| shape | exact tok/s (MFU) | fast tok/s (MFU) | exact / fast | transformers tok/s (MFU) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for p, d in by.items():
        e, f = d.get("exact"), d.get("fast")
        if not (e and f):
            continue
        hf = next((r for r in d.values() if "hf_tokens_per_s" in r), None)
        hf_s = f"{hf['hf_tokens_per_s']:,.0f} ({hf['hf_mfu']:.2f})" if hf else "not run"
        out.append(
            f"| {p} | {e['tokens_per_s']:,.0f} ({e['mfu']:.2f}) | {f['tokens_per_s']:,.0f} ({f['mfu']:.2f}) | "
            f"**{e['tokens_per_s'] / f['tokens_per_s']:.2f}** | {hf_s} |"
        )
    return "\n".join(out)


def plot(series: dict[str, dict[int, float]], png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, pts in sorted(series.items()):
        cs = sorted(pts)
        ax.plot(cs, [pts[c] for c in cs], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rollout")
    ap.add_argument("train", nargs="?")
    ap.add_argument("--png", help="write the tokens/s-vs-concurrency plot here")
    args = ap.parse_args()
    rows = _lines(args.rollout)
    table, series = rollout_table(rows)
    print(table)
    if args.train:
        print()
        print(train_table(_lines(args.train)))
    if args.png and rows:
        gpu = rows[0].get("gpu") or rows[0]["device"]
        plot(series, args.png, f"{rows[0]['preset']} rollout, {gpu}")
        print(f"plot written to {args.png}")


if __name__ == "__main__":
    main()
