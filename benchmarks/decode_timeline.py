"""Where a decoding step's wall time goes on a GPU: the step's kernels on a timeline.

A jitted NSA decoding step (examples/nsa.nsa or `causal`, Triton platform, the compressed cache updated
for row T - 1 and donated from step to step, compiled with nsa_dsl.DECODE_COMPILER_OPTIONS, on
benchmarks/ab_decode_splits.py's inputs; HQ64 HKV4 D128 bf16) is timed (200 steps x 5 rounds, wall ms a
step), then 6 steps run under torch.profiler, whose CUPTI tracing records every kernel of the process,
JAX's included. Printed: the host calls that launched work (count, median and total us), and for two of
the steps each kernel's start from the step's first kernel, the idle gap before it and its duration. Gaps
between a step's kernels that add up to much of its wall time say the step is bound by launching its
kernels (the host), not by running them (the GPU).

    PYTHONPATH=. python3 benchmarks/decode_timeline.py --length 8192 --batch 8 [--pattern causal]
        [--label NAME] [--out DIR] [--set NAME=VALUE ...]

--set NAME=VALUE (repeatable) gives an integer constant of the generated Triton module another value
before the step is traced (e.g. SPLIT_PROGRAMS, SELECTION_MIN_SPLIT_STEPS, MIN_SPLIT_STEPS: how decoding
walks are split into shares), to see each kernel's time under it.

Writes the profiler's Chrome trace to DIR/timeline_<label>_T<length>_B<batch>.json (DIR: --out, else
$OUT, else .). Needs torch with CUDA beside the GPU build of jax (the H200 image has both); its trace
holds JAX's kernels (session 25's runs, results/decode_timeline_*_2026-12-01s25.log).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import torch
from ab_decode_splits import CAUSAL, decoding_inputs
from torch.profiler import ProfilerActivity, profile

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.runtime import dispatch

PROFILED_STEPS = 6


def step_function(pattern: str, batch: int, seq_len: int, constants: dict[str, int]):
    """(the compiled step, its arguments): one query a sequence at row seq_len - 1, the generated
    module's `constants` set first."""
    attention = nsa_dsl.compile(CAUSAL if pattern == "causal" else pattern)
    module = codegen.load_module("triton", attention.plan, dispatch.for_device(None))
    for name, value in constants.items():
        getattr(module, name)  # raises for a name the module lacks
        setattr(module, name, value)
    compressing = pattern != "causal"
    q, k_cache, v_cache, gates, rows = decoding_inputs(batch, seq_len)

    def step(q, k_cache, v_cache, cache, rows):
        if not compressing:
            return attention(q, k_cache, v_cache, query_offset=rows, platform="triton"), cache
        cache = attention.compress(k_cache, v_cache, cache=cache, new_rows=(rows, 1))
        return attention(q, k_cache, v_cache, query_offset=rows, compressed=cache, platform="triton", **gates), cache

    cache = attention.compress(k_cache, v_cache) if compressing else jnp.zeros((1,), jnp.float32)
    jitted = jax.jit(step, donate_argnums=(3,), compiler_options=nsa_dsl.DECODE_COMPILER_OPTIONS)
    return jitted, [q, k_cache, v_cache, cache, rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", default="examples/nsa.nsa", help="a .nsa file, or `causal`")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--label", default="step")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="an integer constant of the generated module")
    args = parser.parse_args()

    constants = {name: int(value) for name, value in (item.split("=") for item in args.set)}
    step, arguments = step_function(args.pattern, args.batch, args.length, constants)

    def run(count):
        out = None
        for _ in range(count):
            out, arguments[3] = step(*arguments)
        jax.block_until_ready(out)

    run(30)
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        run(200)
        rounds.append((time.perf_counter() - start) / 200 * 1e3)
    print(f"{args.label} {constants or ''} T={args.length} B={args.batch}: ms/step {statistics.median(rounds):.4f} "
          f"[{' '.join(f'{t:.4f}' for t in rounds)}] (torch {torch.__version__})", flush=True)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        run(PROFILED_STEPS)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"timeline_{args.label}_T{args.length}_B{args.batch}.json")
    profiler.export_chrome_trace(path)
    with open(path) as trace:
        events = json.load(trace)["traceEvents"]

    host = collections.defaultdict(list)
    for event in events:
        if event.get("cat") in ("cuda_runtime", "cuda_driver"):
            host[event["name"]].append(event["dur"])
    print("host calls (count, median us, total us):")
    for name, durations in sorted(host.items(), key=lambda item: -sum(item[1])):
        print(f"  {name}: {len(durations)}, {statistics.median(durations):.1f}, {sum(durations):.1f}")

    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_step = len(kernels) // PROFILED_STEPS
    print(f"{len(kernels)} kernels, {per_step} a step")
    for index in (2, 3):
        kernels_of_step = kernels[index * per_step:(index + 1) * per_step]
        first, last = kernels_of_step[0], kernels_of_step[-1]
        busy = sum(e["dur"] for e in kernels_of_step)
        print(f"-- step {index}: first to last kernel {last['ts'] + last['dur'] - first['ts']:.1f} us, "
              f"kernels {busy:.1f} us")
        previous_end = first["ts"]
        for event in kernels_of_step:
            print(f"  +{event['ts'] - first['ts']:7.1f}  gap {event['ts'] - previous_end:6.1f}  "
                  f"dur {event['dur']:6.1f}  {event['name'][:70]}")
            previous_end = event["ts"] + event["dur"]


if __name__ == "__main__":
    main()
