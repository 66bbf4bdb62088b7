"""Where the time of a Native Sparse Attention call goes: each stage of a three-branch NSA pattern
timed on its own, on one platform, in one process.

    PYTHONPATH=. python benchmarks/nsa_breakdown.py --platform triton --seq-len 65536 --out DIR
    PYTHONPATH=. python benchmarks/nsa_breakdown.py --platform xla --seq-len 4096 --heads-q 16 \\
        --heads-kv 1 --head-dim 64 --dtype float32        # this CPU

Stages (each a pattern of some of the branches, same block sizes and gates; the compression is
issue 4's l = d = 64 unless --compress-block/--compress-stride say otherwise, e.g. 32/16 as in
examples/nsa.nsa):
  compression      compress(l, d) alone: pooling and the compression attention
  top-k            the selections (attention.selections: compression's lse and the top-16 scoring)
  compression+top-k+selection   compress and topk(16 of 64-token blocks) branches
  window           window(512) alone
  full             all three branches (examples/nsa.nsa)
forward and forward+backward (gradients of q, k, v) for each; times are benchmarks/timing.py's
medians. The session-2 profile put the H200's full forward at 42.7 ms for 64k tokens, 25 of them
in compression + top-k: this is the harness for that work. Prints a table and writes
nsa_breakdown.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from timing import error_text, measure

import nsa_dsl

HEADER = "pattern nsa_stage\nblock 64\ncausal\n"
BRANCHES = {
    "cmp": "branch cmp = compress(block={block}, stride={stride}) gate g_cmp\n",
    "slc": "branch slc = topk(16, block=64, score=cmp, force=global(first=1) | local(2)) gate g_slc\n",
    "swa": "branch swa = window(512) gate g_swa\n",
}
STAGES = {
    "compression": ("cmp",),
    "compression+top-k+selection": ("cmp", "slc"),
    "window": ("swa",),
    "full": ("cmp", "slc", "swa"),
}


def stage_programs(attention, platform, gates):
    """(forward, forward+backward) of `attention` under jit."""

    def forward(q, k, v):
        return attention(q, k, v, platform=platform, **gates)

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v).astype(jnp.float32) ** 2)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--platform", default=None, help="xla, triton, pallas; default: automatic")
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--heads-q", type=int, default=64)
    parser.add_argument("--heads-kv", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--compress-block", type=int, default=64, help="l of compress(l, d)")
    parser.add_argument("--compress-stride", type=int, default=64, help="d of compress(l, d)")
    parser.add_argument("--time-cap-s", type=float, default=2.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for nsa_breakdown.json")
    args = parser.parse_args()

    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    shape_q = (1, args.seq_len, args.heads_q, args.head_dim)
    shape_kv = (1, args.seq_len, args.heads_kv, args.head_dim)
    q = jax.random.normal(keys[0], shape_q, dtype)
    k, v = (jax.random.normal(key, shape_kv, dtype) for key in keys[1:3])
    all_gates = {
        f"g_{name}": g for name, g in zip(BRANCHES, jax.random.uniform(keys[3], (3, 1, args.seq_len, args.heads_q), dtype))
    }
    settings = {**vars(args), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "nsa_dsl": nsa_dsl.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    print(f"{settings['device']}; B=1 T={args.seq_len} HQ={args.heads_q} HKV={args.heads_kv} D={args.head_dim} "
          f"{args.dtype}; platform {args.platform or 'auto'}", flush=True)
    rows = []

    def timed(stage, pass_name, call):
        row = {"stage": stage, "pass": pass_name}
        try:
            result = measure(call, jax.block_until_ready, time_cap_s=args.time_cap_s)
            row.update(ms=result["ms"], first_call_s=result["first_call_s"])
            print(f"{stage:30} {pass_name:8} {result['ms']:10.3f} ms", flush=True)
        except Exception as err:  # noqa: BLE001 - every row is its own measurement
            row["error"] = error_text(err)
            print(f"{stage:30} {pass_name:8} ERROR {row['error']}", flush=True)
        rows.append(row)

    for stage, branches in STAGES.items():
        text = "".join(BRANCHES[b] for b in branches).format(block=args.compress_block, stride=args.compress_stride)
        attention = nsa_dsl.compile(HEADER + text)
        gates = {f"g_{b}": all_gates[f"g_{b}"] for b in branches}
        forward, backward = stage_programs(attention, args.platform, gates)
        timed(stage, "fwd", lambda f=forward: f(q, k, v))
        timed(stage, "fwd+bwd", lambda f=backward: f(q, k, v))
        if branches == ("cmp", "slc"):
            selections = jax.jit(lambda q, k, v, a=attention: a.selections(q, k, v, platform=args.platform))
            timed("top-k (selections)", "fwd", lambda s=selections: s(q, k, v))

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "nsa_breakdown.json"), "w") as f:
        json.dump({"settings": settings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
