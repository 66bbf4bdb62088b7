"""Does timing.measure's batch length move a row? The full NSA pattern's forward (bench_gpu's .nsa
case) and cuDNN's dense causal forward, timed alternately in batches of ~20 ms and ~300 ms in one
process, with nvidia-smi sampling the SM clock and power during each measurement:

    python3 benchmarks/batch_length_ab.py [--length 65536] [--rounds 6]

Each round times both lengths (their order flips every round) with 10 batches each; the summary gives
each row's median over rounds and cuDNN / .nsa at each length. Session 80 added it after one bench_gpu
run a length on an H100 showed no difference beyond the run-to-run noise (NOTES, Session 80).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from timing import MIN_BATCH_MS, measure

# The batch length before session 79, and bench_gpu's default since.
BATCH_LENGTHS_MS = (20.0, MIN_BATCH_MS)


def sampled_measure(run, batch_ms: float) -> dict:
    """timing.measure's result for `run` at `batch_ms`, with the median SM clock (MHz) and power (W)."""
    import jax

    sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "100"], stdout=subprocess.PIPE, text=True)
    result = measure(run, jax.block_until_ready, batches=10, min_batch_ms=batch_ms, time_cap_s=30.0)
    sampler.terminate()
    rows = [line.split(", ") for line in sampler.communicate()[0].splitlines() if line.count(",") == 1]
    result["clock_mhz"] = statistics.median(float(r[0]) for r in rows) if rows else None
    result["power_w"] = statistics.median(float(r[1]) for r in rows) if rows else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for batch_length_ab.json")
    args = parser.parse_args()

    import jax
    from forward_timeline import forward_and_inputs

    nsa, inputs = forward_and_inputs(args.length)
    q, k, v = inputs[:3]
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    runs = {".nsa": lambda: nsa(*inputs), "cudnn": lambda: dense(q, k, v)}
    for run in runs.values():
        jax.block_until_ready(run())  # compiled before any clock starts
    print(f"batch_length_ab: T={args.length}, {args.rounds} rounds, {jax.devices()[0].device_kind}", flush=True)

    results = []
    for round_index in range(args.rounds):
        lengths = BATCH_LENGTHS_MS if round_index % 2 == 0 else BATCH_LENGTHS_MS[::-1]
        for batch_ms in lengths:
            for name, run in runs.items():
                r = sampled_measure(run, batch_ms)
                r.update(round=round_index, batch_ms=batch_ms, name=name)
                results.append(r)
                print(f"round {round_index} batch ~{batch_ms:3.0f} ms {name:5s} {r['ms']:8.3f} ms "
                      f"(batches {min(r['samples_ms']):.3f}-{max(r['samples_ms']):.3f}, {r['calls_per_batch']} calls) "
                      f"SM clock {r['clock_mhz']} MHz, {r['power_w']} W", flush=True)

    def medians(name: str, batch_ms: float) -> list[float]:
        return [r["ms"] for r in results if r["name"] == name and r["batch_ms"] == batch_ms]

    for batch_ms in BATCH_LENGTHS_MS:
        for name in runs:
            ms = medians(name, batch_ms)
            print(f"batch ~{batch_ms:3.0f} ms {name:5s}: median over rounds {statistics.median(ms):.3f} ms "
                  f"({min(ms):.3f}-{max(ms):.3f})")
        ratios = [c / n for n, c in zip(medians(".nsa", batch_ms), medians("cudnn", batch_ms))]
        print(f"batch ~{batch_ms:3.0f} ms cuDNN / .nsa: median {statistics.median(ratios):.3f}x "
              f"({min(ratios):.3f}-{max(ratios):.3f})")
    with open(os.path.join(args.out, "batch_length_ab.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
