"""A Native Sparse Attention layer sharded over every device present: forward and backward.

    python examples/sharded.py [--seq-len 1024] [--batch 2] [--steps 3] [--pattern examples/nsa.nsa]
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/sharded.py   # 8 CPU "devices"

The layer projects x [B, T, model] to queries, keys, values and the three NSA gates (a sigmoid of
a linear map, as in the paper), runs the pattern's attention and projects back. The devices form
a (data, context) mesh: the batch is split over `data` as far as it divides, the sequence over
`context` (keys and values all-gathered, each device's queries at their absolute rows), so one
device is a (1, 1) mesh and the same code runs anywhere. It prints the mesh, the first call
(compilation) and the median step time of forward and of forward+backward, and how far the
sharded output and gradients are from the same layer on one device.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nsa_dsl

GATES = ("g_cmp", "g_slc", "g_swa")


def init_params(key, model_dim, heads_q, heads_kv, head_dim) -> dict:
    shapes = {
        "wq": (model_dim, heads_q * head_dim),
        "wk": (model_dim, heads_kv * head_dim),
        "wv": (model_dim, heads_kv * head_dim),
        "wg": (model_dim, len(GATES) * heads_q),
        "wo": (heads_q * head_dim, model_dim),
    }
    keys = jax.random.split(key, len(shapes))
    return {name: jax.random.normal(k, shape) / math.sqrt(shape[0]) for k, (name, shape) in zip(keys, shapes.items())}


def layer(params, x, attention, heads_q, heads_kv, head_dim):
    """x [B, T, model] -> [B, T, model]: projections, the pattern's attention, projection back."""
    batch, seq_len, _ = x.shape
    q = (x @ params["wq"]).reshape(batch, seq_len, heads_q, head_dim)
    k = (x @ params["wk"]).reshape(batch, seq_len, heads_kv, head_dim)
    v = (x @ params["wv"]).reshape(batch, seq_len, heads_kv, head_dim)
    gates = jax.nn.sigmoid(x @ params["wg"]).reshape(batch, seq_len, len(GATES), heads_q)
    out = attention(q, k, v, **{name: gates[:, :, i] for i, name in enumerate(GATES)})
    return out.reshape(batch, seq_len, heads_q * head_dim) @ params["wo"]


def mesh_for(devices: int, batch: int, seq_len: int) -> jax.sharding.Mesh:
    """(data, context): as many devices on the batch as divide it, the rest on the sequence (their
    count must divide seq_len; a pattern that needs more, such as whole blocks a shard for a top-k
    per block(Q), says so as it is called)."""
    data = math.gcd(devices, batch)
    context = devices // data
    if seq_len % context:
        raise SystemExit(f"--seq-len {seq_len} must be a multiple of the context axis' {context} devices")
    return jax.make_mesh((data, context), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def timed(fn, *args, steps: int):
    """(first call s, median ms of `steps` further calls, result)."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - start) * 1e3)
    return first, statistics.median(samples), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", default=str(Path(__file__).with_name("nsa.nsa")))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--model-dim", type=int, default=256)
    parser.add_argument("--heads-q", type=int, default=8)
    parser.add_argument("--heads-kv", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    attention = nsa_dsl.compile(args.pattern)
    devices = jax.device_count()
    mesh = mesh_for(devices, args.batch, args.seq_len)
    sharded = attention.sharded(mesh, batch_axis="data", sequence_axis="context")
    print(f"{devices} {jax.devices()[0].platform} device(s), mesh {dict(mesh.shape)}; pattern {attention.plan.name}, "
          f"B={args.batch} T={args.seq_len} HQ={args.heads_q} HKV={args.heads_kv} D={args.head_dim} {args.dtype}")

    dims = (args.heads_q, args.heads_kv, args.head_dim)
    dtype = jnp.dtype(args.dtype)
    params = init_params(jax.random.key(0), args.model_dim, *dims)
    params = jax.tree.map(lambda w: w.astype(dtype), params)
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq_len, args.model_dim), dtype)
    # Tokens live where the attention wants them: batch over data, sequence over context.
    x = jax.device_put(x, NamedSharding(mesh, P("data", "context")))

    def loss(params, x, attention):
        return jnp.mean(layer(params, x, attention, *dims).astype(jnp.float32) ** 2)

    forward = jax.jit(lambda params, x: layer(params, x, sharded, *dims))
    forward_backward = jax.jit(jax.value_and_grad(lambda params, x: loss(params, x, sharded)))
    first, ms, out = timed(forward, params, x, steps=args.steps)
    print(f"forward:          first call {first:6.1f} s, median {ms:9.1f} ms")
    first, ms, (value, grads) = timed(forward_backward, params, x, steps=args.steps)
    print(f"forward+backward: first call {first:6.1f} s, median {ms:9.1f} ms (loss {float(value):.5f})")

    # The same layer on one device, unsharded: the sharded run must agree with it.
    single_out = jax.jit(lambda params, x: layer(params, x, attention, *dims))(params, x)
    _, single_grads = jax.jit(jax.value_and_grad(lambda params, x: loss(params, x, attention)))(params, x)

    def relative(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    worst = max(relative(grads[name], single_grads[name]) for name in grads)
    print(f"against one device: output {relative(out, single_out):.1e}, parameter gradients {worst:.1e} (relative)")


if __name__ == "__main__":
    main()
