"""The window and the compression of bench_gpu's NSA pattern on a Hopper GPU: their two Mosaic GPU
forwards apart (hopper_window_forward, hopper_compression_forward) against the one forward that walks
both with the same rows (hopper_window_and_compression_forward), at the issue's shape: B=1, HQ=64,
HKV=4, D=128, window 512, l = d = 64, bfloat16.

    PYTHONPATH=. python benchmarks/window_and_compression_time.py [--lengths 32768,65536]
        [--variants 'A;NAME=VALUE,...'] [--profile LENGTH]

Apart, the two outputs still have to be weighed and added: in the pattern's forward gated_merge adds
them as it writes the output, reading both. One forward writes their gated sum, so the merge reads one
term instead of two: 'apart + sum' adds that sum in XLA for comparison. Each row also gives the
largest difference between the one forward's output and the sum apart, relative to the sum's largest
value. Variants as in topk_time.py. With --profile, one run of each between cuProfilerStart/Stop, for

    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \\
        python3 benchmarks/window_and_compression_time.py --profile 65536 > ncu.csv
    python3 benchmarks/forward_timeline.py --summarise ncu.csv
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_gpu import NSA_PATTERN, Settings  # noqa: E402
from module_constants import module_constants, parse_variant  # noqa: E402
from timing import error_text, measure  # noqa: E402

import nsa_dsl  # noqa: E402
from nsa_dsl import codegen  # noqa: E402
from nsa_dsl.runtime.platform import for_device  # noqa: E402


def forwards(length: int):
    """{name: (jitted function, its arguments)}: the two forwards apart, apart with their gated sum,
    and the one forward, on random inputs at bench_gpu's setting."""
    s = Settings()
    attention = nsa_dsl.compile(NSA_PATTERN.format(block=s.block, selected=s.selected, window=s.window))
    module = codegen.load_module("triton", attention.plan, for_device(attention.config))
    group = s.q_heads // s.kv_heads
    window = module.Static(module.static_kernels_ranges, s.kv_heads, group, s.head_dim, False, seq_len=length)
    compression = module.Compression(s.block, s.block, s.kv_heads, group, s.head_dim, 0, length)
    count = (length - s.block) // s.block + 1
    keys = jax.random.split(jax.random.key(length), 6)
    q = jax.random.normal(keys[0], (length, s.q_heads, s.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (length, s.kv_heads, s.head_dim), jnp.bfloat16) for key in keys[1:3])
    k_cmp, v_cmp = (jax.random.normal(key, (count, s.kv_heads, s.head_dim), jnp.bfloat16) for key in keys[3:5])
    gates = jax.nn.sigmoid(jax.random.normal(keys[5], (2, length, s.q_heads), jnp.float32))
    scale = jnp.asarray([s.head_dim**-0.5], jnp.float32)
    offsets = jnp.asarray([0, length], jnp.int32)
    inputs = (q, k, v, k_cmp, v_cmp, scale, gates)

    def apart(q, k, v, k_cmp, v_cmp, scale, gates):
        window_out, _ = module.hopper_window_forward(window, q, k, v, scale, offsets)
        compression_out, compression_lse = module.hopper_compression_forward(compression, q, k_cmp, v_cmp, scale)
        return window_out, compression_out, compression_lse

    def apart_summed(*args):
        window_out, compression_out, compression_lse = apart(*args)
        gates = args[-1][..., None]
        summed = gates[0] * window_out.astype(jnp.float32) + gates[1] * compression_out.astype(jnp.float32)
        return summed.astype(window_out.dtype), compression_lse

    def fused(q, k, v, k_cmp, v_cmp, scale, gates):
        return module.hopper_window_and_compression_forward(window, compression, q, k, v, k_cmp, v_cmp, scale, *gates)

    return {name: (jax.jit(f), inputs) for name, f in (("apart", apart), ("apart + sum", apart_summed),
                                                       ("fused", fused))}


def timed(call) -> float | str:
    try:
        return round(measure(call, jax.block_until_ready, time_cap_s=1.0)["ms"], 3)
    except Exception as err:  # noqa: BLE001 - every variant is its own measurement
        return error_text(err)


def difference(runs) -> float | str:
    """max |fused - apart + sum| / max |apart + sum|, and the same for the compression's lse."""
    try:
        (want, want_lse), (got, got_lse) = (jax.device_get(f(*args)) for f, args in (runs["apart + sum"], runs["fused"]))
        want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
        seen = np.isfinite(want_lse)
        assert (np.isfinite(got_lse) == seen).all(), "the rows that see no compressed key differ"
        return (float(np.abs(got - want).max() / np.abs(want).max()),
                float(np.abs(got_lse[seen] - want_lse[seen]).max()))
    except Exception as err:  # noqa: BLE001
        return error_text(err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="32768,65536")
    parser.add_argument("--variants", default="")
    parser.add_argument("--profile", type=int, metavar="LENGTH", help="run each once for Nsight Compute")
    args = parser.parse_args()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    if args.profile:
        runs = forwards(args.profile)
        for f, inputs in runs.values():
            jax.block_until_ready(f(*inputs))
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuProfilerStart()
        for name in ("apart", "fused"):
            f, inputs = runs[name]
            jax.block_until_ready(f(*inputs))
        cuda.cuProfilerStop()
        return
    for variant in args.variants.split(";"):
        with module_constants(parse_variant(variant)):
            for length in map(int, args.lengths.split(",")):
                runs = forwards(length)
                row = {"variant": variant or "(as generated)", "T": length}
                row.update({f"{name}_ms": timed(lambda: f(*inputs)) for name, (f, inputs) in runs.items()})
                row["fused_vs_apart_sum_out_rel, lse_abs"] = difference(runs)
                print(row, flush=True)


if __name__ == "__main__":
    main()
