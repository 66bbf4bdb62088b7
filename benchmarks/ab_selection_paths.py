"""A/B timings of the Triton selection kernels on one GPU, each set in one process.

    PYTHONPATH=. python benchmarks/ab_selection_paths.py [--length 65536] [--rounds 2] [--cases gated,block,order]
        [--variants "NAME=VALUE,...;..."] [--hq 64] [--hkv 4] [--head-dim 128]

gated: the same jitted call undifferentiated (the last selection kernel writes the pattern's gated
sum: gated_selection_forward) against the forward of jax.vjp (the plain selection kernel, its
output and lse stored, then XLA sums the gated branches), for explicit selection
(native_sparse_attention with g_slc), native_sparse_attention(g_cmp) and the .nsa NSA pattern
with a 512 window. block: a `per block(Q)` selection as block-sparse attention (Q = 16, 64: the
forward's and dq's programs take tokens of a group that share each loaded block; dk/dv walk the
groups that selected their block) against the per-token kernels (Q = 1), forward and forward +
backward, on the same selections (the tokens of each group of 64 share its 16 random blocks).
order: per-token selections (bench_gpu.py's random ones) through native_sparse_attention, forward
(with the temporary memory XLA assigns it) and forward + backward, under each of --variants:
constants of the generated module (integers, or LAUNCH.<kernel>=WARPSxSTAGES), e.g.
BLOCK_OUTER_PAIRS=0 (the forward key block by key block) against BLOCK_OUTER_PAIRS=1099511627776
(token by token); differences against the first variant.
B=1, bfloat16, 16 blocks of 64, HQ=64, HKV=4, D=128 unless given (the issue 4 setting); median ms
(timing.py) and the largest output difference of each pair. Results: benchmarks/results/ab_*.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_gpu import NSA_PATTERN, Settings, random_selections  # noqa: E402
from module_constants import module_constants, parse_variant  # noqa: E402
from timing import measure  # noqa: E402

import nsa_dsl  # noqa: E402
from nsa_dsl.codegen import cache  # noqa: E402
from nsa_dsl.runtime import layout  # noqa: E402

S, BLOCK = 16, 64


class Heads(NamedTuple):
    """Query heads, KV heads and head dim of the timed arrays."""

    q: int
    kv: int
    dim: int


def gated(length: int, rounds: int, heads: Heads) -> None:
    HQ, HKV, D = heads
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (1, length, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, length, HKV, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, length, HKV, D), jnp.bfloat16)
    g = {name: jax.random.uniform(keys[3 + i], (1, length, HQ), jnp.bfloat16)
         for i, name in enumerate(("g_cmp", "g_slc", "g_swa"))}
    rng = np.random.default_rng(0)
    own_block = np.arange(length)[None, :, None, None] // BLOCK
    indices = jnp.asarray(np.sort(rng.integers(0, 1 << 30, (1, length, HKV, S)) % (own_block + 1), -1).astype(np.int32))
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=BLOCK)
    pattern = nsa_dsl.compile(NSA_PATTERN.format(block=BLOCK, selected=S, window=512))
    cases = {
        "selection": lambda q, k, v: nsa_dsl.native_sparse_attention(
            q, k, v, None, g["g_slc"], indices, S, None, platform="triton", cfg=cfg),
        "nsa g_cmp": lambda q, k, v: nsa_dsl.native_sparse_attention(
            q, k, v, g["g_cmp"], g["g_slc"], None, S, None, platform="triton", cfg=cfg),
        ".nsa": lambda q, k, v: pattern(q, k, v, platform="triton", **g),
    }
    for round_ in range(rounds):
        for name, f in cases.items():
            undifferentiated = jax.jit(f)
            differentiated = jax.jit(lambda q, k, v, f=f: jax.vjp(f, q, k, v)[0])
            a = measure(lambda: undifferentiated(q, k, v), jax.block_until_ready, time_cap_s=1.5)
            b = measure(lambda: differentiated(q, k, v), jax.block_until_ready, time_cap_s=1.5)
            diff = jnp.max(jnp.abs(undifferentiated(q, k, v).astype(jnp.float32)
                                   - differentiated(q, k, v).astype(jnp.float32)))
            print(f"round {round_} {name:10s} gated {a['ms']:.3f} ms  unfused {b['ms']:.3f} ms  "
                  f"max|d| {float(diff):.2e}", flush=True)


def block(length: int, query_blocks: list[int], heads: Heads) -> None:
    HQ, HKV, D = heads
    plan = nsa_dsl.compile(
        f"pattern p\nblock {BLOCK}\ncausal\nbranch cmp = compress(block={BLOCK}, stride={BLOCK}) gate g_cmp\n"
        f"branch slc = topk({S}, block={BLOCK}, score=cmp, force=local(1)) per block({BLOCK}) gate g_slc\n").plan
    module = cache.load_module("triton", plan)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (length, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (length, HKV, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (length, HKV, D), jnp.bfloat16)
    rng = np.random.default_rng(0)
    groups = np.full((length // BLOCK, HKV, S), -1, np.int32)
    for group in range(groups.shape[0]):
        for head in range(HKV):
            count = min(S, group + 1)
            groups[group, head, :count] = rng.choice(group + 1, count, replace=False)
    selected = jnp.asarray(np.repeat(groups, BLOCK, axis=0))
    offsets = layout.sequence_offsets(None, 1, length)
    queries = layout.query_rows(0, 1, length, length, offsets)
    scale = jnp.full((1,), D**-0.5, jnp.float32)
    d_out = jax.random.normal(jax.random.key(1), q.shape, jnp.bfloat16)
    results = {}
    for query_block in query_blocks:
        spec = module.Selection(BLOCK, HKV, HQ // HKV, D, S, query_block, False)

        def attention(q, k, v, spec=spec):
            return module.selection_attention(spec, q, k, v, scale, selected, offsets, queries)

        forward = jax.jit(attention)
        both = jax.jit(lambda q, k, v, attention=attention: jax.vjp(attention, q, k, v)[1](d_out))
        ms = [measure(lambda f=f: f(q, k, v), jax.block_until_ready, time_cap_s=1.5)["ms"] for f in (forward, both)]
        results[query_block] = [np.asarray(x.astype(jnp.float32)) for x in (forward(q, k, v), *both(q, k, v))]
        diff = [float(np.abs(a - b).max()) for a, b in zip(results[query_block], results[query_blocks[0]])]
        print(f"Q={query_block:3d} forward {ms[0]:.3f} ms  forward+backward {ms[1]:.3f} ms  "
              f"max|d| vs Q={query_blocks[0]}: out {diff[0]:.2e} dq {diff[1]:.2e} dk {diff[2]:.2e} dv {diff[3]:.2e}", flush=True)


def order(length: int, variants: list[str], heads: Heads) -> None:
    HQ, HKV, D = heads
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, length, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, length, HKV, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, length, HKV, D), jnp.bfloat16)
    d_out = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    settings = Settings(q_heads=HQ, kv_heads=HKV, head_dim=D, block=BLOCK, selected=S)
    indices = jnp.asarray(random_selections(np.random.default_rng([0, length]), settings, np.arange(length)))
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=BLOCK)

    # Arrays reach the jitted calls as arguments: captured, they would be constants of the
    # executables, which jax's persistent cache compresses (minutes for a 1 GB d_out).
    def attention(q, k, v, indices):
        return nsa_dsl.native_sparse_attention(q, k, v, None, None, indices, S, None, platform="triton", cfg=cfg)

    def largest_difference(a, b):
        return jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))

    difference = jax.jit(largest_difference)
    first = None
    for variant in variants:
        with module_constants(parse_variant(variant)):
            forward = jax.jit(attention)
            both = jax.jit(lambda q, k, v, indices, d_out: jax.vjp(
                lambda *x: attention(*x, indices), q, k, v)[1](d_out))
            ms = [measure(call, jax.block_until_ready, time_cap_s=2.0)["ms"]
                  for call in (lambda: forward(q, k, v, indices), lambda: both(q, k, v, indices, d_out))]
            results = [forward(q, k, v, indices), *both(q, k, v, indices, d_out)]
            temp = forward.lower(q, k, v, indices).compile().memory_analysis().temp_size_in_bytes
        first = first or results
        diff = [float(difference(a, b)) for a, b in zip(results, first)]
        print(f"{variant or 'defaults'}: forward {ms[0]:.3f} ms ({temp / 2**30:.1f} GiB of temporaries)  "
              f"forward+backward {ms[1]:.3f} ms  max|d| vs "
              f"{variants[0] or 'defaults'}: out {diff[0]:.2e} dq {diff[1]:.2e} dk {diff[2]:.2e} dv {diff[3]:.2e}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the gated A/B")
    parser.add_argument("--cases", default="gated,block")
    parser.add_argument("--query-blocks", default="1,16,64", help="Q of the block case's selections (1: per token)")
    parser.add_argument("--variants", default="BLOCK_OUTER_PAIRS=1099511627776;BLOCK_OUTER_PAIRS=0",
                        help="the order case's module constants, variants separated by ';'")
    parser.add_argument("--hq", type=int, default=64, help="query heads")
    parser.add_argument("--hkv", type=int, default=4, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    heads = Heads(args.hq, args.hkv, args.head_dim)
    print(f"ab_selection_paths: T={args.length} B=1 HQ={heads.q} HKV={heads.kv} D={heads.dim} bfloat16, {S} blocks of {BLOCK}, "
          f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    if "gated" in args.cases:
        gated(args.length, args.rounds, heads)
    if "block" in args.cases:
        block(args.length, [int(x) for x in args.query_blocks.split(",")], heads)
    if "order" in args.cases:
        order(args.length, args.variants.split(";"), heads)


if __name__ == "__main__":
    main()
