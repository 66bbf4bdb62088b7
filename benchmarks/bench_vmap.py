"""jax.vmap of a compiled pattern on one GPU: the Triton platform's vmap (the mapped axis folded
into the batch, one launch a kernel: nsa_dsl.runtime.batching) beside the elements called one at
a time in a jax.lax.map (how each launch ran under vmap before: sequentially) and beside the same
arrays called as one batch without vmap (what folding should match).

    PYTHONPATH=. python benchmarks/bench_vmap.py [--pattern examples/nsa.nsa] [--lengths 1024,4096,16384]
        [--sizes 8] [--heads 16,4] [--dim 64] [--dtype bfloat16] [--out DIR]
    python benchmarks/bench_vmap.py --dry-run     # CPU, Triton's interpreter, tiny shapes: proves the harness

An element is one sequence [1, T, HQ, D] (a per-example model's call); V elements are mapped.
Each row is timed forward and forward + backward (the gradient in q, k, v of sum(out * w)),
timing.py's method, all jitted; ratios are lax.map / vmap (above 1: folding is faster) and
batched / vmap (1: folding costs nothing). Writes DIR/bench_vmap.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from timing import error_text, measure  # noqa: E402

WAYS = ("vmap", "lax.map", "batched")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", default=os.path.join(os.path.dirname(HERE), "examples", "nsa.nsa"))
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--sizes", default="8", help="mapped elements V")
    parser.add_argument("--heads", default="16,4", help="query heads, KV heads")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.lengths, args.sizes, args.heads, args.dim, args.dtype = "40", "2", "4,2", 16, "float32"

    import jax
    import jax.numpy as jnp

    import nsa_dsl

    attention = nsa_dsl.compile(args.pattern)
    heads_q, heads_kv = (int(h) for h in args.heads.split(","))
    dtype = jnp.dtype(args.dtype)
    gate_names = sorted({gate.name for gate in attention.plan.gates})
    device = jax.devices()[0].device_kind
    settings = {"pattern": args.pattern, "heads_q": heads_q, "heads_kv": heads_kv, "dim": args.dim,
                "dtype": args.dtype, "device": device, "platform": "triton", "jax": jax.__version__,
                "date": datetime.date.today().isoformat()}
    print("settings:", json.dumps(settings))
    rows = []
    for seq_len in (int(t) for t in args.lengths.split(",")):
        for size in (int(v) for v in args.sizes.split(",")):
            rng = np.random.default_rng(seq_len + size)

            def normal(*shape, dtype=dtype, rng=rng):
                return jnp.asarray(rng.standard_normal(shape), dtype)

            q, weights = normal(size, 1, seq_len, heads_q, args.dim), normal(size, 1, seq_len, heads_q, args.dim)
            k, v = normal(size, 1, seq_len, heads_kv, args.dim), normal(size, 1, seq_len, heads_kv, args.dim)
            gates = {name: jax.nn.sigmoid(normal(size, 1, seq_len, heads_q, dtype=jnp.float32)) for name in gate_names}

            def element(q, k, v, gates):
                return attention(q, k, v, platform="triton", **gates)

            def batched(q, k, v, gates):  # [V, 1, ...] as one batch of V rows
                out = element(*(x.reshape(-1, *x.shape[2:]) for x in (q, k, v)),
                              {n: g.reshape(-1, *g.shape[2:]) for n, g in gates.items()})
                return out.reshape(q.shape)

            forward = {"vmap": jax.vmap(element), "lax.map": lambda *a: jax.lax.map(lambda e: element(*e), a),
                       "batched": batched}
            row = {"seq_len": seq_len, "size": size}
            reference = None
            for way in WAYS:
                def loss(q, k, v, gates, way=way):
                    return (forward[way](q, k, v, gates).astype(jnp.float32) * weights).sum()

                calls = {"fwd": jax.jit(forward[way]), "fwd+bwd": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}
                for what, call in calls.items():
                    try:
                        timed = measure(lambda call=call: call(q, k, v, gates), jax.block_until_ready)
                        row[f"{way} {what} ms"] = round(timed["ms"], 4)
                    except Exception as err:  # a row of the table, not the end of the run
                        row[f"{way} {what} ms"] = error_text(err)
                out = np.asarray(jax.jit(forward[way])(q, k, v, gates), np.float32)
                reference = out if reference is None else reference
                row[f"{way} max diff"] = float(np.abs(out - reference).max())
            for what in ("fwd", "fwd+bwd"):
                ms = {way: row[f"{way} {what} ms"] for way in WAYS}
                if all(isinstance(m, float) for m in ms.values()):
                    row[f"lax.map/vmap {what}"] = round(ms["lax.map"] / ms["vmap"], 3)
                    row[f"batched/vmap {what}"] = round(ms["batched"] / ms["vmap"], 3)
            rows.append(row)
            print(json.dumps(row))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_vmap.json"), "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
