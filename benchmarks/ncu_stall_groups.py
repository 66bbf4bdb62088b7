"""Where a kernel's warps wait, grouped by how often each instruction runs: reads Nsight Compute's
source page with SASS (one or more kernels) and prints, per kernel, the warp-stall samples of the
instructions executed the same number of times (an instruction run once a key step by each of a
CTA's 8 compute warps, once a work item, once a step by the copying warpgroup's 4: each class is a
part of the kernel), then the instructions with the most samples and their two main stall reasons.

    ncu --clock-control none --profile-from-start off -k regex:mosaic -c 2 --section WarpStateStats \\
        --section SourceCounters -o R python3 benchmarks/forward_timeline.py 65536
    ncu -i R.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 benchmarks/ncu_stall_groups.py sass.csv [--classes 12] [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import csv
import io

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(path):
    """(kernel name, rows) for each kernel of the source page: each starts with a "Kernel Name" line."""
    name, lines = None, []
    with open(path) as f:
        for line in f:
            if line.startswith('"Kernel Name"'):
                if lines:
                    yield name, list(csv.DictReader(io.StringIO("".join(lines))))
                name, lines = line.split(",")[1].strip().strip('"'), []
            else:
                lines.append(line)
    if lines:
        yield name, list(csv.DictReader(io.StringIO("".join(lines))))


def count(row, column):
    return int((row.get(column) or "0").replace(",", "") or 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source_csv")
    parser.add_argument("--classes", type=int, default=12, help="execution-count classes to print")
    parser.add_argument("--top", type=int, default=20, help="instructions to print")
    args = parser.parse_args()
    for index, (name, rows) in enumerate(kernels(args.source_csv)):
        stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        samples = collections.Counter()
        instructions = collections.Counter()
        for row in rows:
            samples[count(row, EXECUTED)] += count(row, SAMPLES)
            instructions[count(row, EXECUTED)] += 1
        print(f"kernel {index} {name}: {len(rows)} instructions, {sum(samples.values())} samples")
        for executed, total in samples.most_common(args.classes):
            print(f"  executed {executed:>10}: {instructions[executed]:>5} instructions, {total:>8} samples")
        for row in sorted(rows, key=lambda r: -count(r, SAMPLES))[: args.top]:
            reasons = sorted(stalls, key=lambda c: -count(row, c))[:2]
            print(f"  {row['Address'][-6:]} {count(row, EXECUTED):>9} {count(row, SAMPLES):>7} "
                  f"{','.join(r.removeprefix('stall_') for r in reasons):<22} {row['Source'].strip()[:70]}")


if __name__ == "__main__":
    main()
