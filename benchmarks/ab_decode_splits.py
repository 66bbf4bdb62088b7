"""A/B of a decoding step on the Triton platform, in one process: with the decoding tiles of
session 23 ("on": a shard of few query rows takes range tiles of the group's heads, and walks
over many keys split into shares, key_splits with min_steps 1) and without them ("off": both
patched out of the generated module). Each step is the compressed cache's update for row T - 1
and the new query's attention, jitted with nsa_dsl.DECODE_COMPILER_OPTIONS, the cache donated and
threaded from step to step (as benchmarks/bench_decode.py does); HQ64 HKV4 D128 bf16.

    PYTHONPATH=. python3 benchmarks/ab_decode_splits.py [--pattern examples/nsa.nsa | causal]
        [--lengths 8192,65536] [--batches 1,8]
    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \\
        python3 benchmarks/ab_decode_splits.py --only on|off --lengths 8192 --batches 8
    PYTHONPATH=. python3 benchmarks/ab_decode_splits.py --sweep SELECTION_MIN_SPLIT_STEPS=8,4,2,1

--sweep NAME=V1,V2,...: instead of on/off, one variant per value of the generated module's integer
constant NAME (e.g. SELECTION_MIN_SPLIT_STEPS, the selection's shortest share of a walk, or
MIN_SPLIT_STEPS, the compression's and top-k's), everything else as generated.

Prints the largest difference of each variant's output from the first's and the wall ms a step of
each (200 steps, 5 rounds taken in turns, median and every round). With --only, compiles one
variant and runs 3 steps between cuProfilerStart/Stop, for ncu's per-kernel times.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.runtime import dispatch

HEADS_Q, HEADS_KV, HEAD_DIM = 64, 4, 128
CAUSAL = "pattern dense_causal\nblock 64\ncausal\nbranch main = local(2147483647)\n"
GATES = ("g_cmp", "g_slc", "g_swa")


def decoding_inputs(batch, seq_len):
    """A decoding step's inputs, the same every run: (q [B, 1, HQ, D], the key and value caches
    [B, T, HKV, D], the gates {name: [B, 1, HQ]}, and the rows [B] the queries are at: T - 1)."""
    rng = np.random.default_rng(0)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((batch, seq_len, HEADS_KV, HEAD_DIM)), jnp.bfloat16)
                        for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, 1, HEADS_Q, HEAD_DIM)), jnp.bfloat16)
    gates = {name: jnp.asarray(rng.uniform(size=(batch, 1, HEADS_Q)), jnp.bfloat16) for name in GATES}
    return q, k_cache, v_cache, gates, jnp.full((batch,), seq_len - 1, jnp.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", default="examples/nsa.nsa", help="a .nsa file, or `causal`")
    parser.add_argument("--lengths", default="8192,65536")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--only", help="one variant (on, off, or a --sweep value), 3 steps under cuProfilerStart/Stop")
    parser.add_argument("--sweep", metavar="NAME=V1,V2", help="variants: values of one constant of the module")
    args = parser.parse_args()

    attention = nsa_dsl.compile(CAUSAL if args.pattern == "causal" else args.pattern)
    compressing = args.pattern != "causal"
    module = codegen.load_module("triton", attention.plan, dispatch.for_device(None))
    key_splits, range_settings = module.key_splits, module.range_settings
    if args.sweep:
        constant, values = args.sweep.split("=")
        generated = getattr(module, constant)  # raises for a name the module lacks
        all_variants = [str(generated)] + [v for v in values.split(",") if v != str(generated)]
    else:
        all_variants = ["on", "off"]

    def compiled(variant, q, k_cache, v_cache, cache, gates, rows):
        """The step of `variant`, compiled (it keeps its kernels after the module is patched back)."""
        if args.sweep:
            setattr(module, constant, int(variant))
        elif variant == "on":
            module.key_splits, module.range_settings = key_splits, range_settings
        else:
            def unsplit(programs, steps, min_steps):  # the session's splits use min_steps 1
                return 1 if min_steps == 1 else key_splits(programs, steps, min_steps)

            module.key_splits = unsplit
            module.range_settings = lambda spec, *rest: range_settings(spec._replace(shard_rows=0), *rest)
        dispatch.kernel.cache_clear()
        jax.clear_caches()

        def step(q, k_cache, v_cache, cache, rows):
            if not compressing:
                return attention(q, k_cache, v_cache, query_offset=rows, platform="triton"), cache
            cache = attention.compress(k_cache, v_cache, cache=cache, new_rows=(rows, 1))
            out = attention(q, k_cache, v_cache, query_offset=rows, compressed=cache, platform="triton", **gates)
            return out, cache

        jitted = jax.jit(step, donate_argnums=(3,), compiler_options=nsa_dsl.DECODE_COMPILER_OPTIONS)
        return jitted.lower(q, k_cache, v_cache, cache, rows).compile()

    for seq_len in map(int, args.lengths.split(",")):
        for batch in map(int, args.batches.split(",")):
            q, k_cache, v_cache, gates, rows = decoding_inputs(batch, seq_len)

            def new_cache():
                return attention.compress(k_cache, v_cache) if compressing else jnp.zeros((1,), jnp.float32)

            variants = [args.only] if args.only else all_variants
            steps = {v: compiled(v, q, k_cache, v_cache, new_cache(), gates, rows) for v in variants}
            caches = {v: new_cache() for v in variants}
            outputs = {}
            for v in variants:
                out, caches[v] = steps[v](q, k_cache, v_cache, caches[v], rows)
                outputs[v] = np.asarray(out.astype(jnp.float32))
            if args.only:
                cuda = ctypes.CDLL("libcuda.so.1")
                jax.block_until_ready(caches)
                cuda.cuProfilerStart()
                for _ in range(3):
                    out, caches[args.only] = steps[args.only](q, k_cache, v_cache, caches[args.only], rows)
                jax.block_until_ready(out)
                cuda.cuProfilerStop()
                print(f"T={seq_len} B={batch} {args.only}: profiled 3 steps", flush=True)
                continue
            first = variants[0]
            largest = np.abs(outputs[first]).max()
            for v in variants[1:]:
                difference = np.abs(outputs[v] - outputs[first]).max()
                print(f"T={seq_len} B={batch}: {v} vs {first} max|d| {difference:.3e} (|out| max {largest:.2f})")
            times = {v: [] for v in variants}
            for _ in range(5):
                for v in variants:
                    for _ in range(20):
                        out, caches[v] = steps[v](q, k_cache, v_cache, caches[v], rows)
                    jax.block_until_ready(out)
                    start = time.perf_counter()
                    for _ in range(200):
                        out, caches[v] = steps[v](q, k_cache, v_cache, caches[v], rows)
                    jax.block_until_ready(out)
                    times[v].append((time.perf_counter() - start) / 200 * 1e3)
            rounds = {v: " ".join(f"{x:.4f}" for x in times[v]) for v in variants}
            print(f"T={seq_len} B={batch}: ms/step " + "  ".join(
                f"{v} {statistics.median(times[v]):.4f} [{rounds[v]}]" for v in variants), flush=True)


if __name__ == "__main__":
    main()
