"""Scaling of sharded Native Sparse Attention over 1..N devices (issue 7).

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python benchmarks/bench_sharded.py --out benchmarks/results/sharded.json
        [--kinds data,head,context] [--devices 1,2,4,8] [--batch 8] [--seq-len 8192] [--heads-q 64]
        [--heads-kv 8] [--head-dim 128] [--dtype bfloat16] [--platform auto] [--check-seq-len 1024]
        [--check-dtype float32]
    XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=. python benchmarks/bench_sharded.py \\
        --dry-run --out /tmp/sharded.json       # CPU, tiny shapes: proves the harness

One fixed global problem, examples/nsa.nsa (compression 32/16, the 16 best 64-token blocks with
the first and the 2 local ones forced, a 512-token window, three gates), run forward and
forward+backward (gradients of q, k, v and the gates) on the first n devices for every n of
--devices that the machine has, each sharding kind on a one-axis mesh:
  data     the batch split n ways (batch % n == 0)
  head     KV heads with their query heads split n ways (heads_kv % n == 0)
  context  the sequence split n ways: keys/values all-gathered, queries at their absolute rows
           (seq_len % (n * 64) == 0); the automatic platform is one that takes a query shard (Triton on a GPU)
Inputs are placed on the mesh as the layer partitions them before timing, so a step moves no
inputs. Each kind's efficiency at n devices is t(1 device) / (n * t(n devices)), t(1 device)
being the unsharded call on the same platform. Times are benchmarks/timing.py's medians.

First a check, in float32 at the highest matmul precision on a short sequence (--check-seq-len):
every (kind, n > 1) output and gradient against the unsharded result, as max relative error.
(--check-dtype bfloat16 checks in bf16: Triton compiles float32 NSA kernels slowly, 30-80 s each.)
Every measurement is its own try/except; the JSON at --out is rewritten after every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (issue 7)

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from timing import error_text, measure

import nsa_dsl
from nsa_dsl.runtime import choose_platform

GATES = ("g_cmp", "g_slc", "g_swa")
KINDS = {"data": "batch_axis", "head": "head_axis", "context": "sequence_axis"}


def inputs(key, batch, seq_len, heads_q, heads_kv, head_dim, dtype):
    """q, k, v (normal), gates (uniform in (0, 1)) and an output cotangent (normal)."""
    keys = jax.random.split(key, 5)
    q = jax.random.normal(keys[0], (batch, seq_len, heads_q, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq_len, heads_kv, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq_len, heads_kv, head_dim), dtype)
    gates = dict(zip(GATES, jax.random.uniform(keys[3], (len(GATES), batch, seq_len, heads_q), dtype)))
    d_out = jax.random.normal(keys[4], q.shape, dtype)
    return q, k, v, gates, d_out


def programs(attention, platform):
    """(forward, forward+backward) under jit; the backward is the gradient of <output, d_out>
    with respect to q, k, v and the gates."""
    def call(q, k, v, gates):
        return attention(q, k, v, platform=platform, **gates)

    def inner(q, k, v, gates, d_out):
        return jnp.sum(call(q, k, v, gates).astype(jnp.float32) * d_out.astype(jnp.float32))

    return jax.jit(call), jax.jit(jax.grad(inner, argnums=(0, 1, 2, 3)))


def mesh_of(kind: str, devices: int):
    return jax.make_mesh((devices,), (kind,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:devices])


def place(layer, q, k, v, gates, d_out):
    """The arguments where the layer's shard_map wants them."""
    def put(x, spec):
        return jax.device_put(x, NamedSharding(layer.mesh, spec))

    return (put(q, layer.spec), put(k, layer.spec), put(v, layer.spec),
            {n: put(g, layer.gate_spec) for n, g in gates.items()}, put(d_out, layer.spec))


def fits(kind: str, devices: int, args, block: int) -> str | None:
    """Why `kind` cannot split this problem over `devices`, or None."""
    if kind == "data" and args.batch % devices:
        return f"batch {args.batch} % {devices} devices"
    if kind == "head" and args.heads_kv % devices:
        return f"heads_kv {args.heads_kv} % {devices} devices"
    if kind == "context" and args.seq_len % (devices * block):
        return f"seq_len {args.seq_len} % ({devices} devices x block {block})"
    return None


def relative_error(actual, expected) -> float:
    actual, expected = (np.asarray(x, np.float64) for x in (actual, expected))
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def check(attention, args, device_counts, kinds, report) -> None:
    """Sharded against unsharded, in --check-dtype at the highest matmul precision, --check-seq-len tokens."""
    with jax.default_matmul_precision("highest"):
        q, k, v, gates, d_out = inputs(jax.random.key(1), args.batch, args.check_seq_len, args.heads_q, args.heads_kv,
                                       args.head_dim, jnp.dtype(args.check_dtype))
        check_args = argparse.Namespace(**{**vars(args), "seq_len": args.check_seq_len})
        references = {}
        for kind in kinds:
            for n in device_counts:
                if n == 1 or fits(kind, n, check_args, attention.plan.block_size):
                    continue
                row = {"phase": "check", "kind": kind, "devices": n}
                try:
                    platform = choose_platform(attention.plan, args.platform, None, query_shard=kind == "context")
                    if platform not in references:
                        forward, backward = programs(attention, platform)
                        references[platform] = (forward(q, k, v, gates), backward(q, k, v, gates, d_out))
                    layer = attention.sharded(mesh_of(kind, n), **{KINDS[kind]: kind})
                    forward, backward = programs(layer, platform)
                    placed = place(layer, q, k, v, gates, d_out)
                    out, grads = forward(*placed[:4]), backward(*placed)
                    want_out, want_grads = references[platform]
                    row.update(platform=platform, output_error=relative_error(out, want_out),
                               gradient_error=max(relative_error(a, b) for a, b in
                                                  zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads))))
                except Exception as err:  # noqa: BLE001 - every row is its own measurement
                    row["error"] = error_text(err)
                    traceback.print_exc()
                report.add(row)


def benchmark(attention, args, device_counts, kinds, report) -> None:
    dtype = jnp.dtype(args.dtype)
    q, k, v, gates, d_out = inputs(jax.random.key(0), args.batch, args.seq_len, args.heads_q, args.heads_kv,
                                   args.head_dim, dtype)
    baselines: dict[str, dict] = {}

    def timed(forward, backward, placed) -> dict:
        fwd = measure(lambda: forward(*placed[:4]), jax.block_until_ready, time_cap_s=args.time_cap_s)
        bwd = measure(lambda: backward(*placed), jax.block_until_ready, time_cap_s=args.time_cap_s)
        return {"fwd_ms": fwd["ms"], "fwd_bwd_ms": bwd["ms"], "fwd_first_s": fwd["first_call_s"],
                "fwd_bwd_first_s": bwd["first_call_s"]}

    for kind in kinds:
        for n in device_counts:
            row = {"phase": "scaling", "kind": kind, "devices": n}
            why_not = fits(kind, n, args, attention.plan.block_size)
            if why_not:
                report.add({**row, "skipped": why_not})
                continue
            try:
                platform = choose_platform(attention.plan, args.platform, None, query_shard=kind == "context" and n > 1)
                row["platform"] = platform
                if platform not in baselines:
                    baselines[platform] = timed(*programs(attention, platform), (q, k, v, gates, d_out))
                    report.add({"phase": "scaling", "kind": "unsharded", "devices": 1, "platform": platform,
                                **baselines[platform]})
                if n == 1:
                    row.update(baselines[platform])
                else:
                    layer = attention.sharded(mesh_of(kind, n), **{KINDS[kind]: kind})
                    row.update(timed(*programs(layer, platform), place(layer, q, k, v, gates, d_out)))
                base = baselines[platform]
                for name in ("fwd", "fwd_bwd"):
                    speedup = base[f"{name}_ms"] / row[f"{name}_ms"]
                    row[f"speedup_{name}"], row[f"efficiency_{name}"] = speedup, speedup / n
            except Exception as err:  # noqa: BLE001 - every row is its own measurement
                row["error"] = error_text(err)
                traceback.print_exc()
            report.add(row)


class Report:
    """Rows printed as they come and the JSON rewritten after each."""

    def __init__(self, path: str, settings: dict) -> None:
        self.path, self.data = path, {"settings": settings, "rows": []}
        self.write()

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        print(self.line(row), flush=True)
        self.write()

    @staticmethod
    def line(row: dict) -> str:
        head = f"{row['phase']:8} {row['kind']:9} n={row['devices']} {row.get('platform', ''):7}"
        if "error" in row:
            return f"{head} ERROR {row['error']}"
        if "skipped" in row:
            return f"{head} skipped: {row['skipped']}"
        if row["phase"] == "check":
            return f"{head} output rel. error {row['output_error']:.2e}, gradients {row['gradient_error']:.2e}"
        text = f"{head} fwd {row['fwd_ms']:9.2f} ms  fwd+bwd {row['fwd_bwd_ms']:9.2f} ms"
        if "efficiency_fwd" in row:
            text += (f"  speedup {row['speedup_fwd']:.2f}x / {row['speedup_fwd_bwd']:.2f}x"
                     f"  efficiency {row['efficiency_fwd']:.0%} / {row['efficiency_fwd_bwd']:.0%}")
        return text

    def write(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(self.path + ".tmp", self.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--pattern", default=os.path.join(os.path.dirname(HERE), "examples", "nsa.nsa"))
    parser.add_argument("--kinds", default="data,head,context")
    parser.add_argument("--devices", default="1,2,4,8")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads-q", type=int, default=64)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--platform", default=None, help="xla, triton, pallas; default: automatic")
    parser.add_argument("--check-seq-len", type=int, default=1024, help="0: no check")
    parser.add_argument("--check-dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--time-cap-s", type=float, default=2.0)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU)")
    args = parser.parse_args()
    if args.dry_run:
        args.batch, args.seq_len, args.heads_q, args.heads_kv, args.head_dim = 4, 512, 8, 4, 32
        args.dtype, args.check_seq_len, args.time_cap_s = "float32", 256, 0.2

    attention = nsa_dsl.compile(args.pattern)
    kinds = [kind for kind in args.kinds.split(",") if kind]
    for kind in kinds:
        if kind not in KINDS:
            raise SystemExit(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
    device_counts = [n for n in (int(x) for x in args.devices.split(",")) if n <= jax.device_count()]
    settings = {
        **vars(args), "device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(),
        "device_counts": device_counts, "jax": jax.__version__, "nsa_dsl": nsa_dsl.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    print(f"{jax.device_count()} x {settings['device_kind']}; pattern {attention.plan.name}; B={args.batch} "
          f"T={args.seq_len} HQ={args.heads_q} HKV={args.heads_kv} D={args.head_dim} {args.dtype}; "
          f"devices {device_counts}", flush=True)
    report = Report(args.out, settings)
    if args.check_seq_len:
        check(attention, args, device_counts, kinds, report)
    benchmark(attention, args, device_counts, kinds, report)


if __name__ == "__main__":
    main()
