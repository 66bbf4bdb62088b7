"""Decode with Native Sparse Attention against a key/value cache, one token at a time.

    python examples/decode.py [--prompt 1000] [--new 24] [--batch 2] [--platform xla|triton|pallas]

Compiles examples/nsa.nsa (compression, top-k selection, sliding window), attends the prompts
in one call, keeps their compressed keys beside the key/value cache (SparseAttention.compress),
then runs a jitted decoding step per new token. The sequences' prompts differ in length, so
each sequence decodes at a position of its own, as continuous batching serves them: a step
writes each sequence's key and value rows at its position, recomputes the compressed keys that
pool them (new_rows, one first row per sequence) and attends each new query against the cache
(query_offset, one per sequence; compressed=). The cache buffers are donated, so a step updates
them in place. At the end every decoded row is compared with the same rows of one call over the
whole sequence, and the time per step is printed. No model: queries, keys, values and gates are
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


def at_rows(x, rows):
    """x [B, T, ...] -> [B, 1, ...]: row rows[b] of each batch row b."""
    return jax.vmap(lambda x, row: jax.lax.dynamic_slice_in_dim(x, row, 1))(x, rows)


def steps(text: str) -> int:
    """--new's value: an int of at least 2."""
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"at least 2 tokens (the first step compiles, the others are timed), got {value}")
    return value


def written(cache, new, rows):
    """cache [B, T, ...] with new [B, 1, ...] written at row rows[b] of each batch row b."""
    return jax.vmap(lambda c, n, row: jax.lax.dynamic_update_slice_in_dim(c, n, row, 0))(cache, new, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1000, help="the longest prompt's tokens (the others shorter)")
    parser.add_argument("--new", type=steps, default=24,
                        help="tokens decoded one at a time (at least 2: the first step compiles, the others are timed)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--platform", default=None, help="xla, triton or pallas (default: the best available)")
    args = parser.parse_args()

    attention = nsa_dsl.compile(PATTERN)
    heads_q, heads_kv, head_dim = 8, 2, 64
    prompts = np.linspace(args.prompt, max(args.prompt // 2, 1), args.batch).astype(np.int32)  # one per sequence
    total = args.prompt + args.new  # the cache's rows
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((args.batch, total, heads, head_dim)), jnp.float32)
               for heads in (heads_q, heads_kv, heads_kv))
    gates = {name: jnp.asarray(rng.uniform(size=(args.batch, total, heads_q)), jnp.float32) for name in GATES}

    # Prefill: each prompt's rows of the cache (the rest zeros), their compressed keys, their
    # outputs (one call over the longest prompt; a shorter prompt's outputs past its end unused).
    in_prompt = (np.arange(total)[None, :] < prompts[:, None])[..., None, None]
    k_cache, v_cache = jnp.where(in_prompt, k, 0), jnp.where(in_prompt, v, 0)
    compressed = attention.compress(k_cache, v_cache)
    longest = slice(0, args.prompt)
    attention(q[:, longest], k_cache, v_cache, query_offset=0, compressed=compressed, platform=args.platform,
              **{name: g[:, longest] for name, g in gates.items()})

    @partial(jax.jit, donate_argnums=(0, 1, 2), compiler_options=nsa_dsl.DECODE_COMPILER_OPTIONS)
    def step(k_cache, v_cache, compressed, q_new, k_new, v_new, gates_new, positions):
        """One token of every sequence, sequence b's at row positions[b]: write its key and value
        rows, update the compressed keys, attend its query."""
        k_cache, v_cache = written(k_cache, k_new, positions), written(v_cache, v_new, positions)
        compressed = attention.compress(k_cache, v_cache, cache=compressed, new_rows=(positions, 1))
        out = attention(q_new, k_cache, v_cache, query_offset=positions, compressed=compressed,
                        platform=args.platform, **gates_new)
        return k_cache, v_cache, compressed, out

    @jax.jit
    def new_token(positions):
        """What a model's layer would hand over for the new tokens: their queries, keys, values, gates."""
        return (*(at_rows(x, positions) for x in (q, k, v)), {n: at_rows(g, positions) for n, g in gates.items()})

    outputs, seconds = [], []
    for i in range(args.new):
        positions = jnp.asarray(prompts + i)
        start = time.perf_counter()
        k_cache, v_cache, compressed, out = step(k_cache, v_cache, compressed, *new_token(positions), positions)
        outputs.append(np.asarray(out))  # waits for the step
        seconds.append(time.perf_counter() - start)

    whole = np.asarray(attention(q, k, v, platform=args.platform, **gates))
    decoded = np.stack([whole[b, prompts[b] : prompts[b] + args.new] for b in range(args.batch)])
    error = np.abs(np.concatenate(outputs, axis=1) - decoded).max() / np.abs(decoded).max()
    print(f"pattern {attention.plan.name}, B={args.batch} HQ={heads_q} HKV={heads_kv} D={head_dim} float32 "
          f"on {jax.default_backend()}: prompts of {prompts.tolist()} tokens, then {args.new} decoded one at a time")
    print(f"decoded rows against one call over the whole sequence: max relative difference {error:.2e}")
    print(f"first step (compiles) {seconds[0]:.2f} s; then {np.median(seconds[1:]) * 1e3:.2f} ms a step (median)")


if __name__ == "__main__":
    main()
