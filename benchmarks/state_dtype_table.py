"""The MoE rows of the optimizer state's storage side by side (issue 45: MoE N = 32 at most 1.15 with the
compact state, the fp32 row beside it), from the JSON of two ``bench_moe_step`` runs of one device call
(``benchmarks/issue28_moe.sh OUT compact``: ``--state-dtype float32``, then ``bfloat16``).

Each run measures its own frozen base, so every ratio is a mixed round over the base of the same
process (the base moves by several per cent between calls; inside one process it holds). Printed per
N: round by round and back to back (step overlapped; in order) mixed / base for each state, the step
phase's ms and its effective rate (the bytes a step moves, 36 or 28 a parameter: bench_moe_step
``step_traffic``), and the target's verdict on the compact state's best back-to-back ratio.

  python -m benchmarks.state_dtype_table OUT/moe_state_float32.json OUT/moe_state_bfloat16.json [--target 1.15]
"""

from __future__ import annotations

import argparse
import json


def ratio(row: dict, mixed: str, base: str) -> float | None:
    m, b = row.get(mixed, {}).get("ms"), row.get(base, {}).get("ms")
    return m / b if m and b else None


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def rows_by_n(path: str) -> tuple[str, dict[int, dict]]:
    with open(path) as f:
        data = json.load(f)
    return data.get("state_dtype", "?"), {r["n"]: r for r in data["results"]}


def table(runs: list[tuple[str, dict[int, dict]]], target: float) -> str:
    lines = ["| N adapters x seqs x len | state | mixed / base, round by round | back to back: overlapped; in order "
             "| mixed ms (step ms) | frozen base ms | step GB/s | target <= %.2f |" % target, "|---|---|---|---|---|---|---|---|"]
    ns = sorted({n for _, rows in runs for n in rows})
    for n in ns:
        for dtype, rows in runs:
            r = rows.get(n)
            if r is None:
                continue
            b2b = [ratio(r, "mixed_b2b", "base_b2b"), ratio(r, "mixed_b2b_in_order", "base_b2b")]
            best = min((x for x in [ratio(r, "mixed", "base"), *b2b] if x is not None), default=None)
            verdict = "-" if best is None else ("met" if best <= target else "not met") + f" ({best:.2f})"
            lines.append(f"| {n} x {r['seqs']} x {r['len']} | {dtype} | {fmt(ratio(r, 'mixed', 'base'))} | "
                         f"{fmt(b2b[0])}; {fmt(b2b[1])} | {fmt(r.get('mixed', {}).get('ms'), '.1f')} "
                         f"({fmt(r.get('mixed', {}).get('step_ms'), '.1f')}) | {fmt(r.get('base', {}).get('ms'), '.1f')} | "
                         f"{fmt(r.get('step_traffic', {}).get('gbytes_per_s'), '.0f')} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="bench_moe_step --out JSON files, one per state dtype")
    ap.add_argument("--target", type=float, default=1.15, help="mixed / frozen base to meet (issue 45: 1.15 at N = 32)")
    args = ap.parse_args(argv)
    print(table([rows_by_n(p) for p in args.runs], args.target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
