"""Decode with Native Sparse Attention against a key/value cache, one token at a time.

    python examples/decode.py [--prompt 1000] [--new 24] [--batch 2] [--platform xla|triton|pallas]

Compiles examples/nsa.nsa (compression, top-k selection, sliding window), attends a prompt in
one call, keeps its compressed keys beside the key/value cache (SparseAttention.compress), then
runs a jitted decoding step per new token: write the token's key and value rows, recompute the
compressed keys that pool them (new_rows), attend the new query against the cache
(query_offset, compressed=). The cache buffers are donated, so a step updates them in place.
At the end every decoded row is compared with the same rows of one call over the whole
sequence, and the time per step is printed. No model: queries, keys, values and gates are
random, as a layer's projections would hand them over.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import nsa_dsl

PATTERN = Path(__file__).resolve().parent / "nsa.nsa"
GATES = ("g_cmp", "g_slc", "g_swa")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1000, help="tokens attended in one call before decoding")
    parser.add_argument("--new", type=int, default=24, help="tokens decoded one at a time")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--platform", default=None, help="xla, triton or pallas (default: the best available)")
    args = parser.parse_args()

    attention = nsa_dsl.compile(PATTERN)
    heads_q, heads_kv, head_dim = 8, 2, 64
    total = args.prompt + args.new  # the cache's rows
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((args.batch, total, heads, head_dim)), jnp.float32)
               for heads in (heads_q, heads_kv, heads_kv))
    gates = {name: jnp.asarray(rng.uniform(size=(args.batch, total, heads_q)), jnp.float32) for name in GATES}

    # Prefill: the prompt's rows of the cache (the rest zeros), its compressed keys, its outputs.
    prompt = slice(0, args.prompt)
    k_cache = jnp.zeros_like(k).at[:, prompt].set(k[:, prompt])
    v_cache = jnp.zeros_like(v).at[:, prompt].set(v[:, prompt])
    compressed = attention.compress(k_cache, v_cache)
    attention(q[:, prompt], k_cache, v_cache, query_offset=0, compressed=compressed, platform=args.platform,
              **{name: g[:, prompt] for name, g in gates.items()})

    @partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(k_cache, v_cache, compressed, q_new, k_new, v_new, gates_new, position):
        """One token: write its key and value rows, update the compressed keys, attend its query."""
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k_new, position, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v_new, position, axis=1)
        compressed = attention.compress(k_cache, v_cache, cache=compressed, new_rows=(position, 1))
        out = attention(q_new, k_cache, v_cache, query_offset=position, compressed=compressed,
                        platform=args.platform, **gates_new)
        return k_cache, v_cache, compressed, out

    outputs, seconds = [], []
    for position in range(args.prompt, total):
        row = slice(position, position + 1)
        start = time.perf_counter()
        k_cache, v_cache, compressed, out = step(
            k_cache, v_cache, compressed, q[:, row], k[:, row], v[:, row], {n: g[:, row] for n, g in gates.items()},
            jnp.int32(position),
        )
        outputs.append(np.asarray(out))  # waits for the step
        seconds.append(time.perf_counter() - start)

    whole = np.asarray(attention(q, k, v, platform=args.platform, **gates))[:, args.prompt :]
    error = np.abs(np.concatenate(outputs, axis=1) - whole).max() / np.abs(whole).max()
    print(f"pattern {attention.plan.name}, B={args.batch} HQ={heads_q} HKV={heads_kv} D={head_dim} float32 "
          f"on {jax.default_backend()}: prompt {args.prompt} tokens, then {args.new} decoded one at a time")
    print(f"decoded rows against one call over the whole sequence: max relative difference {error:.2e}")
    print(f"first step (compiles) {seconds[0]:.2f} s; then {np.median(seconds[1:]) * 1e3:.2f} ms a step (median)")


if __name__ == "__main__":
    main()
