"""The GPU's clocks and power while a forward runs back to back: why a forward's time back to back
can exceed the sum of its kernels' times under Nsight Compute (forward_timeline.py), which runs
each kernel alone on an idle, cool card.

    python3 benchmarks/clocks_under_load.py [--length 65536] [--seconds 4]

For bench_gpu.py's full NSA pattern (.nsa with a window) and cuDNN's dense causal forward at the
benchmark's setting, in turn: `--seconds` of back-to-back calls while `nvidia-smi` samples the SM
clock, power draw and active clock-throttle reasons every 100 ms; prints each one's per-call time
and the samples' median and range (the card's settings are read, never changed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def sampled(run, seconds: float) -> tuple[float, list[list[str]]]:
    """(ms a call, nvidia-smi's samples) over `seconds` of back-to-back calls of run()."""
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                               stdout=subprocess.PIPE, text=True)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(3):  # queued behind each other, as a training step's calls are
            result = run()
        result.block_until_ready()
        calls += 3
    elapsed = time.perf_counter() - start
    sampler.terminate()
    rows = [line.split(", ") for line in sampler.communicate()[0].splitlines() if line.count(",") == 2]
    return elapsed * 1e3 / calls, rows


def report(name: str, ms: float, rows: list[list[str]]) -> None:
    clocks = [float(r[0]) for r in rows]
    power = [float(r[1]) for r in rows]
    reasons = sorted({r[2] for r in rows})
    print(f"{name}: {ms:.2f} ms a call; SM clock median {statistics.median(clocks):.0f} MHz "
          f"(min {min(clocks):.0f}, max {max(clocks):.0f}); power median {statistics.median(power):.0f} W "
          f"(max {max(power):.0f}); throttle reasons seen {reasons}; {len(rows)} samples", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()

    import jax
    from bench_gpu import Settings
    from forward_timeline import forward_and_inputs

    s = Settings()
    nsa, (q, k, v, gates) = forward_and_inputs(args.length)
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    print(f"clocks_under_load: T={args.length} {s}, {jax.devices()[0].device_kind}", flush=True)
    idle = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True).stdout.strip()
    print(f"idle: {idle}", flush=True)
    for name, run in ((".nsa cmp+slc+swa forward", lambda: nsa(q, k, v, gates)),
                      ("cuDNN dense causal forward", lambda: dense(q, k, v))):
        run().block_until_ready()  # compiled and warm before the clock starts
        report(name, *sampled(run, args.seconds))


if __name__ == "__main__":
    main()
