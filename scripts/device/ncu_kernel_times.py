#!/usr/bin/env python3
"""Reads `ncu --csv --page raw` tables of per-launch metrics and prints, per kernel name, the launch
count and the median of the metrics named (the raw page also lists every device attribute).

  scripts/device/ncu_kernel_times.py table.csv [table2.csv ...] [--metrics gpu__time_duration.sum,...]
"""
import argparse
import csv
import statistics


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="+")
    parser.add_argument("--metrics", default="gpu__time_duration.sum", help="comma-separated metric names")
    args = parser.parse_args()
    wanted = args.metrics.split(",")
    for path in args.tables:
        rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
        if len(rows) < 3:
            print(f"{path}: no launches")
            continue
        header, body = rows[0], rows[2:]  # row 1 holds the units
        name_col = header.index("Kernel Name")
        metrics = [header.index(m) for m in wanted if m in header]
        by_kernel = {}
        for row in body:
            by_kernel.setdefault(row[name_col][:60], []).append(row)
        print(f"== {path}")
        for name, launches in sorted(by_kernel.items()):
            medians = []
            for i in metrics:
                values = [v for v in (number(r[i]) for r in launches) if v is not None]
                if values:
                    medians.append(f"{header[i]}={statistics.median(values):.6g}")
            print(f"  {name:60s} n={len(launches):4d} " + " ".join(medians))


if __name__ == "__main__":
    main()
