#!/usr/bin/env python3
"""Reads an `ncu --page source --csv --print-source sass` table (the development machine has no ncu)
and prints what a kernel's time goes to: warp instructions and stall samples in total, the stall
reasons, and the SASS instructions holding the most samples with their top two reasons.

  scripts/device/ncu_source_summary.py ncu_source_m1.csv [--top 15]
"""
import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table")
    parser.add_argument("--top", type=int, default=15, help="instructions to list")
    args = parser.parse_args()
    rows = list(csv.reader(line for line in open(args.table) if line.startswith('"')))
    header = next(r for r in rows if "Source" in r and SAMPLES in r)
    body = rows[rows.index(header) + 1:]
    col = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def number(row, name):
        value = row[col[name]].replace(",", "")
        return int(value) if value.isdigit() else 0

    samples = sum(number(r, SAMPLES) for r in body)
    executed = sum(number(r, EXECUTED) for r in body)
    print(f"{len(body)} SASS instructions, {executed} warp instructions executed, {samples} stall samples")
    reasons = sorted(((sum(number(r, s) for r in body), s[6:]) for s in stalls), reverse=True)
    print("stall reasons:", ", ".join(f"{name} {100 * n / max(samples, 1):.1f}%" for n, name in reasons if n))
    print(f"{'index':>6} {'samples':>8} {'executed':>9}  instruction / top reasons")
    for index, row in sorted(enumerate(body), key=lambda item: -number(item[1], SAMPLES))[:args.top]:
        top = sorted(((number(row, s), s[6:]) for s in stalls), reverse=True)[:2]
        why = ", ".join(f"{name} {n}" for n, name in top if n)
        print(f"{index:>6} {number(row, SAMPLES):>8} {number(row, EXECUTED):>9}  {row[col['Source']].strip()[:56]}  ({why})")


if __name__ == "__main__":
    main()
