"""The top-k's share of a forward on a GPU, and whether its selections rank like the exact reference:
bench_gpu.py's NSA pattern (compress(64, 64), top-16 of 64-token blocks forcing the query's own) at
the issue's shape, B=1, HQ=64, HKV=4, D=128, bfloat16.

    PYTHONPATH=. python benchmarks/topk_time.py [--lengths 32768,65536] [--variants 'A;NAME=VALUE,...']
        [--check-length 16384] [--dtype bfloat16]

For each length, times `selections` (the compression forward for its lse, then the top-k: the
difference between two trees or variants is the top-k's) and the compression pattern's forward
alone (the compression's share), then, at --check-length, compares the Triton selections with the
XLA platform's (lax.top_k over the float32 importances): rows whose sets of blocks differ can only
be near-ties of two importances summed in different orders. Each variant (module_constants.parse_variant's
text; ';' between variants, the empty one the module as generated) is timed in the same process.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_gpu import NSA_PATTERN  # noqa: E402
from module_constants import module_constants, parse_variant  # noqa: E402
from timing import error_text, measure  # noqa: E402

import nsa_dsl  # noqa: E402

SELECTION = NSA_PATTERN.format(block=64, selected=16, window=512)


def inputs(length: int, dtype):
    keys = jax.random.split(jax.random.key(length), 3)
    q = jax.random.normal(keys[0], (1, length, 64, 128), dtype)
    k, v = (jax.random.normal(key, (1, length, 4, 128), dtype) for key in keys[1:])
    return q, k, v


def timed(call) -> float | str:
    try:
        return round(measure(call, jax.block_until_ready, time_cap_s=1.0)["ms"], 3)
    except Exception as err:  # noqa: BLE001 - every variant is its own measurement
        return error_text(err)


def check(attention, length: int, dtype) -> None:
    q, k, v = inputs(length, dtype)
    ours = np.asarray(attention.selections(q, k, v, platform="triton")["slc"])[0]
    exact = np.asarray(attention.selections(q, k, v, platform="xla")["slc"])[0]
    ours_sets, exact_sets = np.sort(ours, -1), np.sort(exact, -1)
    differ = np.any(ours_sets != exact_sets, -1)
    print(f"check T={length}: {int(differ.sum())} of {differ.size} (token, KV head) rows choose other blocks "
          "than the XLA platform's exact top-k", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="32768,65536")
    parser.add_argument("--variants", default="")
    parser.add_argument("--check-length", type=int, default=16384)
    parser.add_argument("--dtype", default="bfloat16", help="float16 or float32 run in Triton's interpreter on a CPU")
    args = parser.parse_args()
    attention = nsa_dsl.compile(SELECTION)
    compression = nsa_dsl.compile("pattern cmp\nblock 64\ncausal\nbranch cmp = compress(block=64, stride=64)\n")
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    for variant in args.variants.split(";"):
        with module_constants(parse_variant(variant)):
            for length in map(int, args.lengths.split(",")):
                q, k, v = inputs(length, args.dtype)
                selections = jax.jit(lambda q, k, v: attention.selections(q, k, v, platform="triton"))
                forward = jax.jit(lambda q, k, v: compression(q, k, v, platform="triton"))
                row = {"variant": variant or "(as generated)", "T": length,
                       "selections_ms": timed(lambda: selections(q, k, v)),
                       "compression_fwd_ms": timed(lambda: forward(q, k, v))}
                print(row, flush=True)
    if args.check_length:  # as generated
        check(attention, args.check_length, args.dtype)


if __name__ == "__main__":
    main()
