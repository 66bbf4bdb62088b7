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

The cache is a CompressedCache: that mapping, read-only, with a record of how each branch pooled
its rows (`Pooling`: block, stride, mean or learned). Another pattern's branch of the same name
and stride gives arrays of the same shapes and other numbers, so calls and updates compare the
record with their pattern's branches and refuse a cache that differs. A plain dict is refused
too: it carries no record, and accepting it unchecked would leave the hole open wherever one is
rebuilt (from a checkpoint, by hand); `CompressedCache(arrays, plan)` declares arrays `plan`'s.
The record cannot tell learned functions apart, nor the sequences (cu_seqlens) the rows were
pooled from: keeping those matched is the caller's part. A JAX pytree: the arrays are its leaves,
the record static data, so jit arguments and results, jax.tree.map, device_put and shard_map keep
both.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp

from ..plan import plan as p
from . import layout, validate
from .promotion import allowing_rank_promotion

# Building a cache pools its rows in windows whose gathered key and value blocks (float32) take at most
# this many bytes: all at once, a million tokens of 8 sequences would gather 32 GiB.
POOL_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class Pooling:
    """What a compress branch's compressed keys are, as functions of the keys: key i of a
    sequence pools its rows [i * stride, i * stride + block) by `pool` (mean, or learned: the
    caller's function)."""

    block: int
    stride: int
    pool: str

    def __str__(self) -> str:
        return f"compress(block={self.block}, stride={self.stride}, pool={self.pool})"


def pooling(plan: p.Plan) -> dict[str, Pooling]:
    """{compress branch name: how it pools}: what a compressed cache's rows depend on besides the keys."""
    return {b.name: Pooling(b.block, b.stride, b.pool) for b in plan.branches if isinstance(b, p.CompressBranch)}


class CompressedCache(Mapping):
    """A compressed cache (see the module's docstring): {compress branch name: (k_cmp, v_cmp)},
    read-only, and `pooling`, {branch name: Pooling}, how each branch's rows were pooled.

    SparseAttention.compress returns one. `CompressedCache(arrays, plan)` declares `arrays`
    ({branch: (k_cmp, v_cmp)}, e.g. restored from a checkpoint) the compressed keys of `plan`'s
    compress branches (SparseAttention.plan); calls check only their shapes and dtypes."""

    def __init__(self, arrays: Mapping[str, tuple], plan: p.Plan):
        pooled = pooling(plan)
        if sorted(arrays) != sorted(pooled):
            raise ValueError(
                f"CompressedCache: pattern {plan.name!r} has compress branches {sorted(pooled)}, "
                f"got arrays of {sorted(arrays)}"
            )
        self._set(tuple((name, pooled[name]) for name in sorted(pooled)), [arrays[name] for name in sorted(pooled)])

    def _set(self, record: tuple[tuple[str, Pooling], ...], pairs) -> None:
        # Branches in name order, as jax orders a dict's keys: caches of one pattern built
        # from dicts in any order are one pytree structure.
        self._record = record
        self._arrays = {name: pair for (name, _), pair in zip(record, pairs)}

    @property
    def pooling(self) -> Mapping[str, Pooling]:
        return types.MappingProxyType(dict(self._record))

    def __getitem__(self, name: str):
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        def shapes(pair) -> str:
            return ", ".join(f"{x.dtype}{list(x.shape)}" if hasattr(x, "shape") else type(x).__name__
                             for x in jax.tree.leaves(pair))

        branches = ", ".join(f"{name!r}: {pooled} ({shapes(self._arrays[name])})" for name, pooled in self._record)
        return f"CompressedCache({{{branches}}})"

    def _flatten_with_keys(self):
        return [(jax.tree_util.DictKey(name), pair) for name, pair in self._arrays.items()], self._record

    def _flatten(self):
        return tuple(self._arrays.values()), self._record

    @classmethod
    def _unflatten(cls, record, pairs) -> CompressedCache:
        # Leaves may be anything here (jax.tree.map's results, the objects jax stands in while tracing): no checks.
        cache = cls.__new__(cls)
        cache._set(record, pairs)
        return cache


jax.tree_util.register_pytree_with_keys(
    CompressedCache, CompressedCache._flatten_with_keys, CompressedCache._unflatten, CompressedCache._flatten
)


def validated_arrays(plan: p.Plan, cache: object, shapes: validate.Shapes, num_seqs: int, dtype) -> dict:
    """`cache`'s arrays {branch: (k_cmp, v_cmp)}, checked as `plan`'s compressed cache of keys of
    `shapes` and `dtype` packing num_seqs sequences a batch row: a CompressedCache whose
    branches pooled as `plan`'s branches of their names do (else its rows are other numbers,
    whatever their shapes), of the arrays validate.compressed_cache checks."""
    if not isinstance(cache, CompressedCache):
        unrecorded = (
            ": a plain mapping carries no record of how its rows were pooled; declare arrays that pattern "
            f"{plan.name!r} pooled with nsa_dsl.CompressedCache(arrays, attention.plan)"
        )
        raise ValueError(  # noqa: TRY004 -- every bad input is a ValueError (validate.py)
            "compressed must be the CompressedCache SparseAttention.compress returns, got "
            f"{type(cache).__name__}{unrecorded if isinstance(cache, Mapping) else ''}"
        )
    wanted = pooling(plan)
    for name, pooled in cache.pooling.items():
        if name in wanted and pooled != wanted[name]:
            differences = ", ".join(
                f"{field.name} {getattr(pooled, field.name)} instead of {getattr(wanted[name], field.name)}"
                for field in dataclasses.fields(Pooling)
                if getattr(pooled, field.name) != getattr(wanted[name], field.name)
            )
            raise ValueError(
                f"compressed[{name!r}] was pooled by {pooled}, not as pattern {plan.name!r}'s branch {name!r} pools "
                f"({wanted[name]}): {differences}; a compressed cache is for the pattern that made it"
            )
    return validate.compressed_cache(cache, {name: w.stride for name, w in wanted.items()}, shapes, num_seqs, dtype)


def learned_branches(plan: p.Plan) -> list[str]:
    """The compress branches that pool with the caller's functions (pool=learned), sorted."""
    return sorted(b.name for b in plan.branches if isinstance(b, p.CompressBranch) and b.pool == "learned")


def _updated_rows(count: int, block: int, stride: int, num_seqs: int, rows: int) -> int:
    """How many compressed rows, from the first one that pools a new key row, cover every row
    that pools one of `count` new key rows: in each of the <= min(count, num_seqs) sequences the
    new rows reach, n of them change at most (n + block - 2) // stride + 1 keys."""
    pieces = min(count, num_seqs)
    return min(rows, (count + pieces * (block - 2)) // stride + pieces)


@allowing_rank_promotion
def pool(
    plan: p.Plan,
    key,
    value,
    *,
    cu_seqlens=None,
    pool_fns: Mapping[str, Callable] | None = None,
    cache=None,
    new_rows=None,
) -> CompressedCache:
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
        cache = validated_arrays(plan, cache, shapes, num_seqs, key.dtype)
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
            # Inside shard_map the loop's carry must vary over the keys' axes from the start, as its windows do.
            empty = tuple(layout.varying_like(
                [jnp.zeros((shapes.batch, rows, shapes.heads_kv, shapes.head_dim), key.dtype) for _ in "kv"], (key, value)))

            def window(i, arrays, rows=rows, length=length, pooled_into=pooled_into):
                return pooled_into(arrays, jnp.minimum(i * length, rows - length), length)

            result[name] = jax.lax.fori_loop(0, -(-rows // length), window, empty)
        else:  # recomputing a few more rows than changed changes nothing
            length = _updated_rows(count, branch.block, branch.stride, num_seqs, rows)
            start = layout.first_compressed_row(offsets, first, branch.block, branch.stride)
            result[name] = pooled_into(cache[name], jnp.clip(start, 0, rows - length), length)
    return CompressedCache(result, plan)
