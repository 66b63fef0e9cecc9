"""Developer tool: summarises the per-SASS-line Nsight Compute CSVs of scripts/ncu_history_stalls.sh: for each
launch, the warp-state samples by stall reason (share of all samples) and the lines holding the most samples, with
their two largest reasons.

    python scripts/summarize_history_stalls.py DIR [--top 15]
"""

from __future__ import annotations

import argparse
import csv
import pathlib


def read_lines(path: pathlib.Path) -> list[dict[str, str]]:
    """The SASS rows of one launch's CSV (the header is the row that starts with "Address")."""
    rows = list(csv.reader(path.read_text().splitlines()))
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    header = rows[start]
    return [dict(zip(header, row)) for row in rows[start + 1:] if len(row) == len(header)]


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarize(path: pathlib.Path, top: int) -> None:
    lines = read_lines(path)
    reasons = [key for key in lines[0] if key.startswith("stall_") and "(Not Issued)" not in key]
    totals = {key: sum(number(line[key]) for line in lines) for key in reasons}
    samples = sum(totals.values())
    executed = sum(number(line["Instructions Executed"]) for line in lines)
    print(f"== {path.name}: {len(lines)} SASS lines, {executed:.0f} warp instructions, {samples:.0f} samples")
    print("   " + ", ".join(f"{key[6:]} {value / samples:.1%}" for key, value in
                            sorted(totals.items(), key=lambda item: -item[1]) if value / samples >= 0.01))
    ranked = sorted(lines, key=lambda line: -number(line["Warp Stall Sampling (All Samples)"]))
    for line in ranked[:top]:
        own = sorted(((number(line[key]), key[6:]) for key in reasons), reverse=True)[:2]
        share = number(line["Warp Stall Sampling (All Samples)"]) / samples
        print(f"   {line['Address']:>6} {share:6.1%}  {line['Source'][:60]:<60} "
              + ", ".join(f"{name} {value / samples:.1%}" for value, name in own))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    for path in sorted(args.directory.glob("history-stalls-[0-9].csv")):
        summarize(path, args.top)


if __name__ == "__main__":
    main()
