"""Where a training forward's time goes on a GPU, kernel by kernel: bench_gpu.py's full NSA pattern
(compress + topk + window, NSA_PATTERN; or `--case selection`, native_sparse_attention with its random
selections) at one length, jitted, run once, then run once more between cuProfilerStart/Stop for
Nsight Compute to time each kernel it launches:

    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \\
        python3 benchmarks/forward_timeline.py 65536 > ncu.csv
    python3 benchmarks/forward_timeline.py --summarise ncu.csv

The summary lists each kernel's time in launch order and their sum (ncu runs kernels one at a time,
so the sum is close to, not equal to, the forward's time back to back).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def forward_and_inputs(length: int, case: str = "nsa"):
    """(jitted forward, its arguments) at bench_gpu's setting: the full NSA pattern (NSA_PATTERN with
    its gates) for case "nsa", else native_sparse_attention with bench_gpu's random selections."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_gpu import NSA_PATTERN, Settings, random_selections

    import nsa_dsl

    s = Settings()
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, length, s.q_heads, s.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, length, s.kv_heads, s.head_dim), jnp.bfloat16) for key in keys[1:3])
    if case == "nsa":
        attention = nsa_dsl.compile(NSA_PATTERN.format(block=s.block, selected=s.selected, window=s.window))
        gates = jax.nn.sigmoid(jax.random.normal(keys[3], (3, 1, length, s.q_heads), jnp.float32)).astype(jnp.bfloat16)
        forward = jax.jit(lambda q, k, v, g: attention(q, k, v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], platform="triton"))
        return forward, (q, k, v, gates)
    indices = jnp.asarray(random_selections(np.random.default_rng([0, length]), s, length))
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=s.block)
    forward = jax.jit(lambda q, k, v, i: nsa_dsl.native_sparse_attention(
        q, k, v, None, None, i, s.selected, None, platform="triton", cfg=cfg))
    return forward, (q, k, v, indices)


def profile(length: int, case: str) -> None:
    import jax

    forward, args = forward_and_inputs(length, case)
    jax.block_until_ready(forward(*args))
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    jax.block_until_ready(forward(*args))
    cuda.cuProfilerStop()
    print(f"forward_timeline: {case} T={length}: profiled one forward", file=sys.stderr, flush=True)


def summarise(path: str) -> None:
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's csv rows, not the program's output
    rows = [r for r in csv.DictReader(lines) if r["Metric Name"] == "gpu__time_duration.sum"]
    scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
    total = 0.0
    for row in rows:
        ms = float(row["Metric Value"].replace(",", "")) * scale[row["Metric Unit"]]
        total += ms
        print(f"{ms:9.3f} ms  {row['Kernel Name'][:100]}")
    print(f"{total:9.3f} ms  the sum of {len(rows)} kernels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("length", nargs="?", type=int, default=65536)
    parser.add_argument("--case", choices=("nsa", "selection"), default="nsa")
    parser.add_argument("--summarise", metavar="CSV", help="print the kernel times of an ncu csv instead")
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise)
    else:
        profile(args.length, args.case)


if __name__ == "__main__":
    main()
