"""Stage timings of the key-block-outer selection forward on one GPU (selection_forward_by_block),
against the per-token forward, at the issue 4 setting (B=1, HQ=64, HKV=4, D=128, bfloat16, 16 of
bench_gpu.py's random causal blocks of 64):

    PYTHONPATH=. python benchmarks/diag_block_outer.py [LENGTH [VARIANT ...]]

Times, each jitted alone (timing.py): the pair lists with their segments, the parts kernel, XLA's
merge of the parts (merge_splits), the per-token forward, and native_sparse_attention's whole
forward with the module's constants; prints the largest differences of the merged output and lse
from the per-token forward's. A VARIANT (module_constants.parse_variant's NAME=VALUE,...: e.g.
SEGMENT_ROWS=1024,LAUNCH.selection_forward_by_block=4x3) times the lists and the parts kernel again
under those constants. Runs: results/diag_block_outer_*_2026-12-02s{28,29,30}*.log."""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_gpu import Settings, random_selections  # noqa: E402
from module_constants import module_constants, parse_variant  # noqa: E402
from timing import measure  # noqa: E402

import nsa_dsl  # noqa: E402
from nsa_dsl import codegen  # noqa: E402
from nsa_dsl.runtime import layout, triton_glue  # noqa: E402

HQ, HKV, D, S, BLOCK = 64, 4, 128, 16, 64


def stage(name, f, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    first_s = time.perf_counter() - start
    ms = measure(lambda: f(*args), jax.block_until_ready, time_cap_s=1.0)["ms"]
    print(f"{name}: {ms:.3f} ms (first call {first_s:.2f} s)", flush=True)
    return out


def main() -> None:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float16  # the interpreter has no bfloat16
    print(f"diag_block_outer: T={length} HQ={HQ} HKV={HKV} D={D} {jnp.dtype(dtype).name}, {S} blocks of {BLOCK}, "
          f"device {jax.devices()[0].device_kind}, memory {triton_glue._device_memory_bytes()} bytes", flush=True)
    loads = []  # the arguments of the generated module's loads
    load = codegen.load_module
    codegen.load_module = lambda *arguments: loads.append(arguments) or load(*arguments)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (length, HQ, D), dtype)
    k = jax.random.normal(keys[1], (length, HKV, D), dtype)
    v = jax.random.normal(keys[2], (length, HKV, D), dtype)
    indices = jnp.asarray(random_selections(np.random.default_rng([0, length]), Settings(), np.arange(length)))
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=BLOCK)
    whole = jax.jit(lambda q, k, v, i: nsa_dsl.native_sparse_attention(
        q[None], k[None], v[None], None, None, i, S, None, platform="triton", cfg=cfg))
    stage("native_sparse_attention forward", whole, q, k, v, indices)
    codegen.load_module = load
    module = load(*loads[0])
    spec = module.Selection(BLOCK, HKV, HQ // HKV, D, S)
    offsets = layout.sequence_offsets(None, 1, length)
    queries = layout.query_rows(0, 1, length, length, offsets)
    tiles = module.selection_tiles(spec, offsets, queries, length)
    blocks = layout.sequence_blocks(offsets, length, BLOCK)
    scale = jnp.full((1,), D**-0.5, jnp.float32)
    selected = indices[0]  # distinct, causal and -1 padded: already clean
    print("KV heads a launch key block by key block (None: token by token):", module._block_outer_heads(spec, tiles, q),
          flush=True)

    def lists(selected):
        return layout.selection_by_key_block(selected, tiles.seq, blocks, token_entries=True,
                                             segment_rows=module.SEGMENT_ROWS)

    def parts(q, k, v, pairs):
        return module._block_outer_parts(spec, tiles, q, k, v, scale, blocks, pairs, 0, HKV)

    difference = jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
    pairs = stage("pair lists", jax.jit(lists), selected)
    segments = np.diff(np.asarray(pairs.segments))
    print(f"pairs {segments.sum()}, segments {segments.size} ({(segments > 0).sum()} not empty, the longest "
          f"{segments.max()} pairs)", flush=True)
    out_parts, lse_parts = stage("parts kernel", jax.jit(parts), q, k, v, pairs)
    merged = stage("merge_splits", jax.jit(lambda o, lse: module.merge_splits(o, lse, q.dtype)), out_parts, lse_parts)
    token = stage("per-token forward", jax.jit(
        lambda q, k, v: module._forward_launch(spec, tiles, q, k, v, scale, selected, 1)), q, k, v)
    finite = jnp.isfinite(token[1])
    print(f"max|d| against the per-token forward: out {float(difference(merged[0], token[0])):.2e}, lse "
          f"{float(jnp.max(jnp.where(finite, jnp.abs(merged[1] - token[1]), 0.0))):.2e}", flush=True)
    del merged, token

    for variant in sys.argv[2:]:
        with module_constants(parse_variant(variant)):
            codegen.load_module(*loads[0])  # the same module, its constants set
            varied = stage(f"parts kernel, {variant}", jax.jit(parts), q, k, v, jax.jit(lists)(selected))
        print(f"   max|d| against the default parts: {float(difference(varied[0], out_parts)):.2e}", flush=True)
        del varied


if __name__ == "__main__":
    main()
