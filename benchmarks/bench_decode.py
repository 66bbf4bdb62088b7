"""One decoding step of a compiled pattern against a key/value cache, side by side with dense
attention, on one GPU.

    PYTHONPATH=. python benchmarks/bench_decode.py [--pattern examples/nsa.nsa] [--lengths 8192,32768,65536,131072]
        [--batches 1,8] [--impls ours-triton,ours-triton-pooling,ours-pallas,ours-xla,cudnn,xla-dense] [--breakdown]
        [--positions last|spread] [--xla-default-graphs] [--steps-per-call N] [--out DIR]
    python benchmarks/bench_decode.py --dry-run     # CPU, tiny shapes: proves the harness

A step is what a serving loop runs for each new token once its key and value rows are in the cache
(B sequences, each at its last row T - 1, T rows of cache): for nsa_dsl, the compressed cache's
update for that row (SparseAttention.compress(..., cache=, new_rows=(T - 1, 1))) and the attention
of the new query (query_offset=T - 1, compressed=cache), jitted together (with
nsa_dsl.DECODE_COMPILER_OPTIONS, as every row here unless --xla-default-graphs), the cache donated and
threaded from step to step as a serving loop would; `ours-triton-pooling` is
the same call without the compressed cache, pooling all T keys every step. Dense attention, the
baseline: the new query against all T rows (jax.nn.dot_product_attention, cuDNN and XLA), with the
pattern's gates off (only the attention itself). `--positions spread`: the sequences decode at
positions of their own, as continuous batching serves them (sequence b at row T - 1 - b * T // (2B):
query_offset and new_rows one per sequence), and dense attention reads each sequence's rows up to
its position (key_value_seq_lengths). Every step reads the whole selection a real model
makes: random inputs, the pattern's own top-k. `--steps-per-call N`: each call runs N steps in a
jax.lax.fori_loop, each step's query the previous step's output (a dependent chain, as generation's),
so that the time a step is the device's, not the host's dispatch of one jitted call (a step of a
few tens of microseconds of kernels is otherwise bound by the dispatch).

Prints a table (median ms per step, timing.py's method; ratio dense cuDNN / row: above 1, faster
than dense), the K/V bytes a step must read at least, and the largest difference of each nsa_dsl
row's output from the XLA backend's; writes DIR/bench_decode.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from timing import error_text, measure  # noqa: E402

IMPLS = ("ours-triton", "ours-triton-pooling", "ours-pallas", "ours-xla", "cudnn", "xla-dense")
# --breakdown: parts of ours-triton's step timed alone (the cache's update; the compression
# attention and top-k that choose the blocks; each branch with only its gate passed).
PARTS = ("update", "selections", "branch cmp", "branch slc", "branch swa")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", default=os.path.join(os.path.dirname(HERE), "examples", "nsa.nsa"))
    parser.add_argument("--lengths", default="8192,32768,65536,131072")
    parser.add_argument("--batches", default="1,8", help="sequences decoded together")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--heads-q", type=int, default=64)
    parser.add_argument("--heads-kv", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=os.environ.get("OUT") or ".")
    parser.add_argument("--breakdown", action="store_true", help="also time the parts of ours-triton's step")
    parser.add_argument("--positions", choices=("last", "spread"), default="last",
                        help="every sequence at row T - 1, or each at a position of its own")
    parser.add_argument("--xla-default-graphs", action="store_true",
                        help="compile every step with XLA's default options, not nsa_dsl.DECODE_COMPILER_OPTIONS")
    parser.add_argument("--steps-per-call", type=int, default=1, metavar="N",
                        help="N dependent steps in one jitted loop a call; ms a step = ms a call / N")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, ours-xla and xla-dense")
    args = parser.parse_args()
    if args.steps_per_call < 1 or (args.steps_per_call > 1 and args.breakdown):
        parser.error("--steps-per-call takes N >= 1, and no --breakdown (its parts are not a step)")

    import jax
    import jax.numpy as jnp

    import nsa_dsl

    if args.dry_run:
        args.lengths, args.batches, args.impls, args.dtype = "300", "1,2", "ours-xla,xla-dense", "float32"
        args.heads_q, args.heads_kv, args.head_dim = 4, 2, 16
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    impls = [x for x in args.impls.split(",") if x]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        parser.error(f"unknown --impls {unknown}; choose from {IMPLS}")
    dtype = jnp.dtype(args.dtype)
    compiler_options = None if args.xla_default_graphs else nsa_dsl.DECODE_COMPILER_OPTIONS
    attention = nsa_dsl.compile(args.pattern)
    gate_names = sorted({g.name for g in attention.plan.gates})
    hq, hkv, d = args.heads_q, args.heads_kv, args.head_dim
    where = "row T - 1" if args.positions == "last" else "rows T - 1 - b * T // (2B) (sequence b)"
    settings = (f"pattern {attention.plan.name} ({args.pattern}), HQ={hq} HKV={hkv} D={d} {dtype.name}, one new query "
                f"per sequence at {where} of a T-row cache, gates {gate_names} random; "
                f"compiler options {compiler_options or 'XLA defaults'} (every row), "
                f"{args.steps_per_call} step(s) a call, "
                f"device {jax.devices()[0].device_kind}, "
                f"jax {jax.__version__}")
    print(f"bench_decode: {settings}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    results = {"settings": settings, "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": []}

    def sync(x):
        jax.block_until_ready(x)

    for seq_len in lengths:
        for batch in batches:
            rng = np.random.default_rng(seq_len + batch)
            keys = jax.random.split(jax.random.key(seq_len * 31 + batch), 3)
            q = jax.random.normal(keys[0], (batch, 1, hq, d), dtype)
            k_cache = jax.random.normal(keys[1], (batch, seq_len, hkv, d), dtype)
            v_cache = jax.random.normal(keys[2], (batch, seq_len, hkv, d), dtype)
            gates = {n: jnp.asarray(rng.uniform(size=(batch, 1, hq)), dtype) for n in gate_names}
            if args.positions == "last":
                position, lengths_read = jnp.int32(seq_len - 1), {}
            else:
                position = jnp.asarray(seq_len - 1 - np.arange(batch) * (seq_len // (2 * batch)), jnp.int32)
                lengths_read = {"key_value_seq_lengths": position + 1}
            cache = attention.compress(k_cache, v_cache)
            rows_read = int(np.sum(np.broadcast_to(np.asarray(position) + 1, (batch,))))  # dense: up to each position
            kv_bytes = 2 * rows_read * hkv * d * dtype.itemsize
            print(f"\n== T={seq_len} B={batch}: dense attention reads {kv_bytes / 1e6:.0f} MB of K/V a step ==",
                  flush=True)
            print(f"{'implementation':28s} {'ms/step':>9s} {'x dense':>8s} {'first s':>8s} {'max|d| vs xla':>14s}")

            # Every call is (q, k_cache, v_cache, compressed cache, position) -> (output, cache). Those
            # that update the cache get it donated and hand the new one to the next call, as a serving
            # loop does (without donation each step would copy the whole compressed cache).
            def jitted(step, donate):
                """`step` (q, kc, vc, c, t) -> (out, c) jitted, --steps-per-call steps of it a call."""
                if args.steps_per_call > 1:
                    one_step = step

                    def step(q, kc, vc, c, t):
                        def body(_, carry):
                            q, c = carry
                            out, c = one_step(q, kc, vc, c, t)
                            return out.astype(q.dtype), c

                        return jax.lax.fori_loop(0, args.steps_per_call, body, (q, c))

                return jax.jit(step, donate_argnums=(3,) if donate else (), compiler_options=compiler_options)

            def updating(step):
                return jitted(step, True), True

            def reading(step):
                def read(q, kc, vc, c, t):
                    return step(q, kc, vc, c, t), c

                return jitted(read, False), False

            def nsa_step(platform, compressed):
                if not compressed:
                    return reading(lambda q, kc, vc, c, t: attention(
                        q, kc, vc, query_offset=t, platform=platform, **gates))

                def step(q, kc, vc, c, t):
                    c = attention.compress(kc, vc, cache=c, new_rows=(t, 1))
                    return attention(q, kc, vc, query_offset=t, compressed=c, platform=platform, **gates), c

                return updating(step)

            def part(name):
                platform = "xla" if args.dry_run else "triton"
                if name == "update":
                    return updating(lambda q, kc, vc, c, t: (
                        None, attention.compress(kc, vc, cache=c, new_rows=(t, 1))))
                if name == "selections":
                    return reading(lambda q, kc, vc, c, t: attention.selections(
                        q, kc, vc, query_offset=t, compressed=c, platform=platform))
                gate_name = {b.name: b.gate.name for b in attention.plan.branches}[name.split()[1]]
                return reading(lambda q, kc, vc, c, t: attention(
                    q, kc, vc, query_offset=t, compressed=c, platform=platform, **{gate_name: gates[gate_name]}))

            calls = {
                "ours-triton": lambda: nsa_step("triton", True),
                "ours-triton-pooling": lambda: nsa_step("triton", False),
                "ours-pallas": lambda: nsa_step("pallas", True),
                "ours-xla": lambda: nsa_step("xla", True),
                "cudnn": lambda: reading(lambda q, kc, vc, c, t: jax.nn.dot_product_attention(
                    q, kc, vc, implementation="cudnn", **lengths_read)),
                "xla-dense": lambda: reading(lambda q, kc, vc, c, t: jax.nn.dot_product_attention(
                    q, kc, vc, implementation="xla", **lengths_read)),
                **{f"part: {name}": (lambda name=name: part(name)) for name in PARTS},
            }
            outputs, dense_ms = {}, None
            order = (["ours-xla"] if "ours-xla" in impls else []) + [i for i in impls if i != "ours-xla"]
            for impl in order + [f"part: {name}" for name in PARTS if args.breakdown]:
                row = {"impl": impl, "seq_len": seq_len, "batch": batch, "kv_bytes": kv_bytes}
                try:
                    fn, updates = calls[impl]()
                    state = {"cache": jax.tree.map(jnp.copy, cache)}

                    def call(fn=fn, updates=updates, state=state):
                        out, new_cache = fn(q, k_cache, v_cache, state["cache"], position)
                        if updates:
                            state["cache"] = new_cache
                        return out, new_cache

                    timing = measure(call, sync, time_cap_s=0.75)
                    out = call()[0]
                    row.update(ms=timing["ms"] / args.steps_per_call, first_call_s=timing["first_call_s"])
                    if impl.startswith("ours"):
                        outputs[impl] = np.asarray(out.astype(jnp.float32))
                        if impl != "ours-xla" and "ours-xla" in outputs:
                            row["max_diff_vs_xla"] = float(np.abs(outputs[impl] - outputs["ours-xla"]).max())
                    if impl == "cudnn" or (impl == "xla-dense" and dense_ms is None):
                        dense_ms = row["ms"]
                except Exception as err:  # one failing row must not lose the others
                    row["error"] = error_text(err)
                results["rows"].append(row)
            for row in [r for r in results["rows"] if r["seq_len"] == seq_len and r["batch"] == batch]:
                if "error" in row:
                    print(f"{row['impl']:28s} error: {row['error']}", flush=True)
                    continue
                row["x_dense"] = dense_ms / row["ms"] if dense_ms else None
                ratio = f"{row['x_dense']:8.2f}" if dense_ms else f"{'-':>8s}"
                diff = f"{row['max_diff_vs_xla']:14.2e}" if "max_diff_vs_xla" in row else f"{'-':>14s}"
                print(f"{row['impl']:28s} {row['ms']:9.4f} {ratio} {row['first_call_s']:8.1f} {diff}", flush=True)
            with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
                json.dump(results, f, indent=1)
    print(f"\nwritten {os.path.join(args.out, 'bench_decode.json')} ({time.strftime('%H:%M:%S')})")


if __name__ == "__main__":
    main()
