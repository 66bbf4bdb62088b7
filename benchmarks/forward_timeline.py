"""Where a training forward's time goes on a GPU, kernel by kernel: bench_gpu.py's full NSA pattern
(compress + topk + window, NSA_PATTERN; or `--case selection`, native_sparse_attention with its random
selections) at one length, jitted, run once, then run once more between cuProfilerStart/Stop for
Nsight Compute to time each kernel it launches:

    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \\
        python3 benchmarks/forward_timeline.py 65536 > ncu.csv
    python3 benchmarks/forward_timeline.py --summarise ncu.csv

The summary lists each kernel's time in launch order and their sum (ncu runs kernels one at a time,
so the sum is close to, not equal to, the forward's time back to back). Where the csv also holds
`dram__bytes_read.sum`, `dram__bytes_write.sum` and `lts__t_sector_hit_rate.pct` (add them to
--metrics; `--print-units base` or not), each kernel's HBM bytes and L2 hit rate are listed too.
`--constants "SEGMENT_ROWS=2048,LAUNCH.<kernel>=4x1"` profiles the forward with those constants of
the generated modules (module_constants.py), e.g. to compare a setting's kernels beside main's.
`--backward` profiles the forward and the backward (jax.vjp's pullback of a random cotangent) instead;
`--hq`, `--hkv` and `--head-dim` change bench_gpu's heads and head dim; `--documents N` packs N
sequences into the row as bench_gpu's option does (cu_seqlens traced).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def forward_and_inputs(length: int, case: str = "nsa", backward: bool = False, **settings):
    """(jitted forward, its arguments) at bench_gpu's setting (`settings` replace its fields): the
    full NSA pattern (NSA_PATTERN with its gates) for case "nsa", else native_sparse_attention with
    bench_gpu's random selections. With `backward`, the jitted function runs the forward and its
    pullback of a random cotangent, and returns the input gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_gpu import NSA_PATTERN, Settings, packing, random_selections

    import nsa_dsl

    s = dataclasses.replace(Settings(), **settings)
    cu_seqlens, positions = packing(s, length)
    packed = {} if cu_seqlens is None else {"cu_seqlens": jnp.asarray(cu_seqlens)}
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, length, s.q_heads, s.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, length, s.kv_heads, s.head_dim), jnp.bfloat16) for key in keys[1:3])
    if case == "nsa":
        attention = nsa_dsl.compile(NSA_PATTERN.format(block=s.block, selected=s.selected, window=s.window))
        gates = jax.nn.sigmoid(jax.random.normal(keys[3], (3, 1, length, s.q_heads), jnp.float32)).astype(jnp.bfloat16)
        def forward(q, k, v, extra):
            g, packed = extra
            return attention(q, k, v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], platform="triton", **packed)
        args = (q, k, v, (gates, packed))
    else:
        indices = jnp.asarray(random_selections(np.random.default_rng([0, length]), s, positions))
        cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=s.block)

        def forward(q, k, v, extra):
            i, packed = extra
            return nsa_dsl.native_sparse_attention(q, k, v, None, None, i, s.selected, packed.get("cu_seqlens"),
                                                   platform="triton", cfg=cfg)
        args = (q, k, v, (indices, packed))
    if not backward:
        return jax.jit(forward), args
    d_out = jax.random.normal(jax.random.key(1), q.shape, q.dtype)

    def forward_and_backward(q, k, v, extra, d_out):
        return jax.vjp(lambda q, k, v: forward(q, k, v, extra), q, k, v)[1](d_out)
    return jax.jit(forward_and_backward), (*args, d_out)


def profile(length: int, case: str, constants: str = "", backward: bool = False, **settings) -> None:
    import jax
    from module_constants import module_constants, parse_variant

    with module_constants(parse_variant(constants)):
        forward, args = forward_and_inputs(length, case, backward, **settings)
        jax.block_until_ready(forward(*args))
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuProfilerStart()
        jax.block_until_ready(forward(*args))
        cuda.cuProfilerStop()
    what = "forward and backward" if backward else "forward"
    print(f"forward_timeline: {case} T={length} {settings or ''}: profiled one {what}", file=sys.stderr, flush=True)


# ncu's units, to ms, GB and percent.
UNITS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0,
         "byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "%": 1.0}


def summarise(path: str) -> None:
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's csv rows, not the program's output
    kernels: dict[str, dict] = {}  # by ncu's launch ID, in launch order
    for row in csv.DictReader(lines):
        kernel = kernels.setdefault(row["ID"], {"name": row["Kernel Name"]})
        kernel[row["Metric Name"]] = float(row["Metric Value"].replace(",", "")) * UNITS[row["Metric Unit"]]
    total = 0.0
    for kernel in kernels.values():
        ms = kernel["gpu__time_duration.sum"]
        total += ms
        traffic = ""
        if "dram__bytes_read.sum" in kernel:
            traffic = (f"  HBM read {kernel['dram__bytes_read.sum']:6.2f} GB write {kernel['dram__bytes_write.sum']:6.2f} GB"
                       f"  L2 hits {kernel['lts__t_sector_hit_rate.pct']:5.1f}%")
        print(f"{ms:9.3f} ms{traffic}  {kernel['name'][:100]}")
    print(f"{total:9.3f} ms  the sum of {len(kernels)} kernels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("length", nargs="?", type=int, default=65536)
    parser.add_argument("--case", choices=("nsa", "selection"), default="nsa")
    parser.add_argument("--summarise", metavar="CSV", help="print the kernel times of an ncu csv instead")
    parser.add_argument("--constants", default="", help="generated modules' constants, as module_constants.py reads them")
    parser.add_argument("--backward", action="store_true", help="profile the forward and its backward")
    parser.add_argument("--hq", type=int, help="query heads (bench_gpu's by default)")
    parser.add_argument("--hkv", type=int, help="KV heads")
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--documents", type=int, help="sequences packed into the row (cu_seqlens)")
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise)
    else:
        settings = {name: value for name, value in
                    (("q_heads", args.hq), ("kv_heads", args.hkv), ("head_dim", args.head_dim),
                     ("documents", args.documents)) if value is not None}
        profile(args.length, args.case, args.constants, args.backward, **settings)


if __name__ == "__main__":
    main()
