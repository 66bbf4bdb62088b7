"""Compressed keys kept beside a key/value cache, for decoding.

A compress branch pools every key row of the sequence into its compressed keys, so a decoding
step that pooled them again would read the whole cache: as many bytes as dense attention.
Instead the caller keeps them: `pool` computes every batch row's compressed keys once (after a
prefill) and then, after new key rows were written, recomputes only the few compressed keys
that pool them (`new_rows`), and calls take them as `compressed=`. A step then reads the
compressed keys, the selected blocks and the window: what Native Sparse Attention's decoding
was designed to read.

Layout: {compress branch name: (k_cmp, v_cmp)}, each [B, R, HKV, D] in the keys' dtype, holding
its batch row's layout.pool_compressed rows (R = T // stride + the number of sequences of the row:
1, or N packed ones). Every backend pools in float32 and rounds the pooled keys to the keys' dtype
before attending to them, so a cache in that dtype holds exactly what a call would pool: a call
given the cache computes what it would without it (up to the order XLA sums a mean in), and a
decoding step reads half the bytes of a float32 cache (at a million tokens the cache is most of
what a step reads). Kernels read the B rows' arrays in place (layout.cached_compressed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from ..plan import plan as p
from . import layout, validate

# Building a cache pools its rows in windows whose gathered key and value blocks (float32) take at most
# this many bytes: all at once, a million tokens of 8 sequences would gather 32 GiB.
POOL_BYTES = 256 * 2**20


def strides(plan: p.Plan) -> dict[str, int]:
    """{compress branch name: its stride}: what a compressed cache's shapes depend on."""
    return {b.name: b.stride for b in plan.branches if isinstance(b, p.CompressBranch)}


def learned_branches(plan: p.Plan) -> list[str]:
    """The compress branches that pool with the caller's functions (pool=learned), sorted."""
    return sorted(b.name for b in plan.branches if isinstance(b, p.CompressBranch) and b.pool == "learned")


def _updated_rows(count: int, block: int, stride: int, num_seqs: int, rows: int) -> int:
    """How many compressed rows, from the first one that pools a new key row, cover every row
    that pools one of `count` new key rows: in each of the <= min(count, num_seqs) sequences the
    new rows reach, n of them change at most (n + block - 2) // stride + 1 keys."""
    pieces = min(count, num_seqs)
    return min(rows, (count + pieces * (block - 2)) // stride + pieces)


def pool(
    plan: p.Plan,
    key,
    value,
    *,
    cu_seqlens=None,
    pool_fns: Mapping[str, Callable] | None = None,
    cache=None,
    new_rows=None,
) -> dict[str, tuple[jax.Array, jax.Array]]:
    """The compressed cache of `plan` for key/value [B, T, HKV, D] (see the module's docstring).

    With `cache` (an earlier result for keys of the same shapes) and `new_rows` = (first, count),
    the key rows [first, first + count) of every batch row having been written since (first an
    int or integer scalar, or one per batch row [B], may be traced; count a static int): `cache`
    with only the compressed keys that pool those rows recomputed, O(count) work instead of O(T)."""
    branches = {b.name: b for b in plan.branches if isinstance(b, p.CompressBranch)}
    if not branches:
        raise ValueError(f"pattern {plan.name!r} has no compress branch: it has no compressed keys to keep")
    key, value, shapes = validate.key_value_inputs(key, value)
    cu = validate.cu_seqlens(cu_seqlens, shapes)
    offsets = layout.sequence_offsets(cu, 1, shapes.seq_len)  # of one batch row
    num_seqs = offsets.shape[0] - 1
    functions = validate.pool_fns(pool_fns, learned_branches(plan), plan.name)
    if (cache is None) != (new_rows is None):
        raise ValueError("cache and new_rows go together: pass both to update a compressed cache, neither to build one")
    if cache is not None:
        cache = validate.compressed_cache(cache, strides(plan), shapes, num_seqs, key.dtype)
        first, count = validate.new_rows(new_rows, shapes)

    result = {}
    for name, branch in branches.items():
        rows = layout.compressed_rows(shapes.seq_len, num_seqs, branch.stride)

        def pooled_into(arrays, start, length, branch=branch, pool_fn=functions.get(branch.name)):
            """`arrays` with rows [start, start + length) of every batch row's compressed keys
            pooled anew (start: one for every batch row, or one per batch row [B])."""
            def pooled(k, v, old_k, old_v, start):
                window = layout.pool_compressed(k, v, offsets, branch.block, branch.stride, pool_fn, k.dtype,
                                                (start, length))
                return tuple(jax.lax.dynamic_update_slice_in_dim(old, new, start, axis=0)
                             for old, new in ((old_k, window.k), (old_v, window.v)))

            return jax.vmap(pooled)(key, value, *arrays, jnp.broadcast_to(start, (shapes.batch,)))

        if cache is None:  # every row, a window of at most POOL_BYTES of gathered blocks at a time
            block_bytes = 2 * shapes.batch * branch.block * shapes.heads_kv * shapes.head_dim * 4
            length = min(rows, max(POOL_BYTES // block_bytes, 1))
            empty = tuple(jnp.zeros((shapes.batch, rows, shapes.heads_kv, shapes.head_dim), key.dtype) for _ in "kv")

            def window(i, arrays, rows=rows, length=length, pooled_into=pooled_into):
                return pooled_into(arrays, jnp.minimum(i * length, rows - length), length)

            result[name] = jax.lax.fori_loop(0, -(-rows // length), window, empty)
        else:  # recomputing a few more rows than changed changes nothing
            length = _updated_rows(count, branch.block, branch.stride, num_seqs, rows)
            start = layout.first_compressed_row(offsets, first, branch.block, branch.stride)
            result[name] = pooled_into(cache[name], jnp.clip(start, 0, rows - length), length)
    return result
