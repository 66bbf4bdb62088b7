"""Input checks: every bad input becomes a ValueError that names the argument.

Checks use shapes and dtypes only, so they work on traced values under `jit`; value checks
(cu_seqlens' order and range) run only when the values are concrete.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .layout import compressed_rows

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


@dataclass(frozen=True)
class Shapes:
    batch: int
    seq_len: int  # of the keys: block tables and sequences (cu_seqlens) are in key rows
    heads_q: int
    heads_kv: int
    head_dim: int
    query_len: int  # seq_len, or fewer when the queries are a shard of the sequence axis


def _array(name: str, value: object) -> jax.Array:
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        return jnp.asarray(value)
    if isinstance(value, (list, tuple)):
        try:
            return jnp.asarray(value)
        except (TypeError, ValueError, OverflowError) as err:  # OverflowError: ints no integer dtype holds
            raise ValueError(f"{name} must be an array, got {type(value).__name__} that is not one ({err})") from None
    raise ValueError(f"{name} must be an array, got {type(value).__name__}")


_INT32 = np.iinfo(np.int32)


def _index_array(name: str, value: object) -> jax.Array:
    """An integer array as int32, out-of-range values clamped (not wrapped): a huge index must
    stay out of range, never turn into a valid one."""
    if isinstance(value, (np.ndarray, np.generic, list, tuple)):
        host = np.asarray(value)
        if np.issubdtype(host.dtype, np.integer):
            value = _as_int32(host, np)
    array = _array(name, value)
    if not jnp.issubdtype(array.dtype, jnp.integer):
        return array
    return _as_int32(array, jnp)


def _as_int32(array, xp):
    """`array` (numpy's or jax's integers, xp its module) as int32, clamped to int32's range by
    the bounds its dtype reaches past only: a bound outside the dtype's own range would wrap in
    it (int16's -2**31 is 0) and make every value that bound."""
    info = xp.iinfo(array.dtype)
    low = _INT32.min if info.min < _INT32.min else None
    high = _INT32.max if info.max > _INT32.max else None
    if low is not None or high is not None:
        array = xp.clip(array, low, high)
    return array.astype(xp.int32)


def concrete_shape(name: str, shape: tuple) -> tuple[int, ...]:
    """`shape`, whose sizes must be numbers: jax.export's symbolic sizes cannot size block tables."""
    if not all(isinstance(size, int) for size in shape):
        raise ValueError(
            f"{name} must have concrete sizes, got shape {shape}: the block tables and kernels are built "
            "for one length and head count (export one function per shape rather than a symbolic one)"
        )
    return shape


def _is_concrete(x: jax.Array) -> bool:
    return not isinstance(x, jax.core.Tracer)


def attention_inputs(
    query: object, key: object, value: object, *, query_shard: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array, Shapes]:
    """The inputs as arrays, and their shapes. With `query_shard` (a query_offset was given) the
    queries may be fewer than the keys: one shard of the sequence axis against all of it."""
    query, key, value = _array("query", query), _array("key", key), _array("value", value)
    for name, x in (("query", query), ("key", key), ("value", value)):
        concrete_shape(name, x.shape)
    if query.ndim != 4:
        raise ValueError(f"query must be [batch, seq_len, num_q_heads, head_dim], got shape {query.shape}")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"query must be float32, bfloat16, float16 or float64, got {query.dtype}")
    batch, query_len, heads_q, head_dim = query.shape
    if batch < 1 or query_len < 1 or heads_q < 1 or head_dim < 1:
        raise ValueError(f"query must have a non-empty batch, seq_len, num_q_heads and head_dim, got shape {query.shape}")
    for name, x in (("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [batch, seq_len, num_kv_heads, head_dim], got shape {x.shape}")
        length_ok = x.shape[1] >= query_len if query_shard else x.shape[1] == query_len
        if x.shape[0] != batch or not length_ok or x.shape[3] != head_dim:
            length = f"seq_len >= {query_len} (query's rows are a shard of it)" if query_shard else f"seq_len={query_len}"
            offset = (": fewer queries than keys (a decoding step) need query_offset, the key row of the first query"
                      if not query_shard and x.shape[1] > query_len else "")
            raise ValueError(
                f"{name} must be [batch={batch}, {length}, num_kv_heads, head_dim={head_dim}] "
                f"like query, got shape {x.shape}{offset}"
            )
        if x.dtype != query.dtype:
            raise ValueError(f"{name} must have query's dtype {query.dtype}, got {x.dtype}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {key.shape}, got {value.shape}")
    heads_kv = key.shape[2]
    if heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(
            f"key has {heads_kv} heads, which must divide query's {heads_q} heads (grouped-query attention)"
        )
    return query, key, value, Shapes(batch, key.shape[1], heads_q, heads_kv, head_dim, query_len)


def _key_row(name: str, value: object, batch: int | None = None) -> int | jax.Array:
    """A row of the keys' sequence axis: an int, or an int32 scalar array when traced. With
    `batch`, also one row per batch row: an integer [batch] array (int32; may be traced)."""
    integer = jnp.issubdtype(getattr(value, "dtype", type(value)), jnp.integer)
    if batch is not None and np.ndim(value) == 1 and integer:
        if np.shape(value) != (batch,):
            raise ValueError(f"{name}: one row per batch row must have shape ({batch},), got {np.shape(value)}")
        return _index_array(name, value)
    if isinstance(value, (bool, np.bool_)) or not (np.ndim(value) == 0 and integer):
        per_row = f", or an integer [{batch}] array (one per batch row)" if batch is not None else ""
        raise ValueError(f"{name} must be an int or an integer scalar array{per_row}, got {value!r}")
    row = _index_array(name, value) if isinstance(value, jax.Array) else int(value)
    return int(row) if _is_concrete(row) else row


def _known_rows(row: int | jax.Array) -> np.ndarray | None:
    """The values of a _key_row result, where they are known (not traced)."""
    if isinstance(row, int):
        return np.array([row])
    return np.asarray(row) if _is_concrete(row) else None


def key_value_inputs(key: object, value: object) -> tuple[jax.Array, jax.Array, Shapes]:
    """key and value [batch, seq_len, num_kv_heads, head_dim] as arrays, and their shapes (a
    query of key's shape): the inputs of a compressed cache."""
    key, value = _array("key", key), _array("value", value)
    if key.ndim != 4 or 0 in key.shape:
        raise ValueError(
            f"key must be a non-empty [batch, seq_len, num_kv_heads, head_dim] array, got shape {key.shape}"
        )
    if key.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"key must be float32, bfloat16, float16 or float64, got {key.dtype}")
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(
            f"value must have key's shape {key.shape} and dtype {key.dtype}, got {value.shape} {value.dtype}"
        )
    batch, seq_len, heads_kv, head_dim = key.shape
    return key, value, Shapes(batch, seq_len, heads_kv, heads_kv, head_dim, seq_len)


def pool_fns(given: Mapping[str, object] | None, learned: list[str], pattern: str) -> dict[str, object]:
    """The pooling functions of the compress branches declared with pool=learned (`learned`):
    exactly one callable for each."""
    functions = dict(given or {})
    if sorted(functions) != learned:
        raise ValueError(
            f"pool_fns: pattern {pattern!r} pools with learned functions in branches {learned or 'none'}; "
            f"got functions for {sorted(functions) or 'none'}"
        )
    for branch, fn in functions.items():
        if not callable(fn):
            raise ValueError(f"pool_fns[{branch!r}] must be a callable (k_blocks, v_blocks) -> (k_cmp, v_cmp)")
    return functions


def compressed_cache(value: Mapping, strides: Mapping[str, int], shapes: Shapes, num_seqs: int, dtype):
    """The arrays of a compressed cache (nsa_dsl.runtime.compressed_cache, whose validated_arrays
    checks how they were pooled) of keys of `shapes` and `dtype` packing num_seqs sequences a
    batch row: {compress branch: (k_cmp, v_cmp)} for every branch in `strides`, each
    [batch, seq_len // stride + num_seqs, num_kv_heads, head_dim] in `dtype`."""
    if sorted(value) != sorted(strides):
        raise ValueError(
            f"compressed must be the cache SparseAttention.compress returns, {{branch: (k_cmp, v_cmp)}} for the "
            f"compress branches {sorted(strides)}, got {sorted(value)}"
        )
    out = {}
    for name, stride in strides.items():
        pair = value[name]
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"compressed[{name!r}] must be a pair (k_cmp, v_cmp), got {type(pair).__name__}")
        wanted = (shapes.batch, compressed_rows(shapes.seq_len, num_seqs, stride), shapes.heads_kv, shapes.head_dim)
        arrays = tuple(_array(f"compressed[{name!r}]", x) for x in pair)
        for part, array in zip(("k_cmp", "v_cmp"), arrays):
            if array.shape != wanted or array.dtype != dtype:
                raise ValueError(
                    f"compressed[{name!r}] {part} must be {jnp.dtype(dtype).name} {wanted} (the cache of keys "
                    f"[batch, seq_len, num_kv_heads, head_dim] = "
                    f"{[shapes.batch, shapes.seq_len, shapes.heads_kv, shapes.head_dim]}"
                    f"{', cu_seqlens of ' + str(num_seqs) + ' sequences' if num_seqs > 1 else ''}), "
                    f"got {array.dtype} {array.shape}"
                )
        out[name] = arrays
    return out


def new_rows(value: object, shapes: Shapes) -> tuple[int | jax.Array, int]:
    """(first, count): key rows [first, first + count) written since a compressed cache was made,
    first an int or integer scalar, or one per batch row (an integer [batch] array; may be
    traced), count an int >= 1 (a static shape)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"new_rows must be a pair (first, count) of key rows, got {value!r}")
    first, count = value
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or not 1 <= count <= shapes.seq_len:
        raise ValueError(f"new_rows: count must be an int between 1 and seq_len={shapes.seq_len}, got {count!r}")
    first = _key_row("new_rows: first", first, shapes.batch)
    known = _known_rows(first)
    if known is not None and not ((known >= 0) & (known <= shapes.seq_len - count)).all():
        raise ValueError(
            f"new_rows: first must be between 0 and seq_len - count = {shapes.seq_len - count}, "
            f"got {known.tolist() if np.ndim(first) else first}"
        )
    return first, int(count)


def query_offset(value: object, shapes: Shapes, whole_blocks: int | None = None) -> int | jax.Array:
    """The key row of the first query (the queries are rows [offset, offset + query_len) of the
    keys' sequence axis: a shard for context parallelism, new tokens against a key/value cache when
    decoding), an int or an int32 scalar, or one per batch row (an integer [batch] array: sequences
    decoded at positions of their own), any of them traced or not. Any rows, unless `whole_blocks`
    is given (a pattern whose top-k scores per block(Q) of queries): then a shard must start and
    end on a multiple of it."""
    offset = _key_row("query_offset", value, shapes.batch)
    block = whole_blocks or 1
    if shapes.query_len < shapes.seq_len and shapes.query_len % block:
        raise ValueError(
            f"query: a shard of the sequence axis ({shapes.query_len} of key's {shapes.seq_len} rows) must hold "
            f"a multiple of the pattern's block ({block}) rows, as its top-k scores whole groups of queries"
        )
    known = _known_rows(offset)
    if known is not None and ((known < 0) | (known % block != 0) | (known + shapes.query_len > shapes.seq_len)).any():
        multiple = f"a multiple of the pattern's block ({block}) " if block > 1 else ""
        raise ValueError(
            f"query_offset must be {multiple}between 0 and seq_len - query rows = "
            f"{shapes.seq_len - shapes.query_len}, got {known.tolist() if np.ndim(offset) else offset}"
        )
    return offset


def scoring_query(value: object, query: jax.Array, shapes: Shapes) -> jax.Array:
    """The queries of every row of the keys' sequence axis, [batch, seq_len, num_q_heads, head_dim]
    in query's dtype: a shard's top-k scores its per block(Q) groups from them."""
    array = _array("scoring_query", value)
    wanted = (shapes.batch, shapes.seq_len, shapes.heads_q, shapes.head_dim)
    if array.shape != wanted:
        raise ValueError(f"scoring_query must have shape {wanted} (every row of key's sequence axis), got {array.shape}")
    if array.dtype != query.dtype:
        raise ValueError(f"scoring_query must have query's dtype {query.dtype}, got {array.dtype}")
    return array


def gates(given: Mapping[str, object], declared: tuple[str, ...], pattern: str, shapes: Shapes) -> dict[str, jax.Array]:
    """The gates that were passed (None = not passed), each [batch, query rows, num_q_heads] float."""
    out = {}
    for name, gate in given.items():
        if gate is None:
            continue
        if name not in declared:
            known = ", ".join(declared) if declared else "none"
            raise ValueError(f"{name}: pattern {pattern!r} has no gate of that name (its gates: {known})")
        gate = _array(name, gate)
        expected = (shapes.batch, shapes.query_len, shapes.heads_q)
        if gate.shape != expected:
            raise ValueError(f"{name} must be [batch, seq_len, num_q_heads] = {list(expected)}, got shape {gate.shape}")
        if gate.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be a float array, got {gate.dtype}")
        out[name] = gate
    return out


def cu_seqlens(value: object, shapes: Shapes) -> jax.Array | None:
    """int32 [N + 1] offsets of the sequences packed into the single batch row, or None. A
    concrete one is checked; a traced one (a jitted step's argument) cannot be, and is made a
    layout the kernels can take on device: clipped to [0, seq_len], its first 0, never decreasing
    (a valid one unchanged), so that an invalid one makes no kernel read outside its arrays."""
    if value is None:
        return None
    cu = _index_array("cu_seqlens", value)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D [num_seqs + 1] with num_seqs >= 1, got shape {cu.shape}")
    if not jnp.issubdtype(cu.dtype, jnp.integer):
        raise ValueError(f"cu_seqlens must be an integer array, got {cu.dtype}")
    if shapes.batch != 1:
        raise ValueError(f"cu_seqlens packs sequences into one batch row: batch must be 1, got {shapes.batch}")
    if _is_concrete(cu):
        host = np.asarray(cu, np.int64)  # int32 differences wrap: [0, 20, -2**31] would pass
        if host[0] != 0 or (np.diff(host) < 0).any() or host[-1] > shapes.seq_len:
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at most at seq_len={shapes.seq_len}, "
                f"got {np.asarray(value).tolist()}"  # as given, not as clamped to int32
            )
        return cu
    first = jnp.arange(cu.shape[0]) == 0  # not .at[0].set(0), a scatter: backwards trace none (test_backward_traces_no_scatter)
    return lax.cummax(jnp.where(first, 0, jnp.clip(cu, 0, shapes.seq_len)))


def softmax_scale(value: object, shapes: Shapes) -> float | jax.Array:
    """1/sqrt(head_dim) by default; a number, or a scalar array that may be traced."""
    if value is None:
        return 1.0 / math.sqrt(shapes.head_dim)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"softmax_scale must be finite, got {value!r}")
        return float(value)
    scale = _array("softmax_scale", value)
    if scale.ndim != 0 or not (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
        hint = ""
        if scale.ndim == 1 and jnp.issubdtype(scale.dtype, jnp.integer):
            # The one argument order that differs: ejkernel's Kernel.run, which NativeSparseAttention keeps.
            hint = (" (cu_seqlens? the NativeSparseAttention kernel object, as ejkernel's Kernel.run, takes"
                    " softmax_scale 8th and cu_seqlens 9th, where native_sparse_attention takes cu_seqlens 8th:"
                    " pass it as cu_seqlens=)")
        raise ValueError(f"softmax_scale must be a real scalar, got shape {scale.shape} dtype {scale.dtype}{hint}")
    if _is_concrete(scale) and not np.isfinite(np.asarray(scale)):
        raise ValueError(f"softmax_scale must be finite, got {np.asarray(scale).item()!r}")
    return scale


def _per_token(name: str, value: jax.Array, shapes: Shapes, block: int, cu: jax.Array | None, trailing: tuple[int, ...]):
    """value in the per-token layout [B, T, HKV, *trailing], accepting ejkernel's per-query-block
    layout [B, HKV, ceil(T / block), *trailing] as well (not with cu_seqlens: its blocks are
    the packed row's, not the sequences')."""
    b, t, h = shapes.batch, shapes.query_len, shapes.heads_kv
    num_blocks = -(-t // block)
    rank = 3 + len(trailing)
    if value.ndim == rank and value.shape[:3] == (b, t, h) and value.shape[3:] == trailing:
        return value
    if value.ndim == rank and value.shape[:3] == (b, h, num_blocks) and value.shape[3:] == trailing and cu is None:
        per_block = jnp.moveaxis(value, 1, 2)  # [B, blocks, HKV, ...]
        return per_block[:, jnp.arange(t) // block]
    extra = "".join(f", {n}" for n in trailing) if trailing else ""
    layouts = f"[batch, seq_len, num_kv_heads{extra}] = {[b, t, h, *trailing]}"
    if cu is None:
        layouts += f" or [batch, num_kv_heads, num_blocks{extra}] = {[b, h, num_blocks, *trailing]}"
    raise ValueError(f"{name} must be {layouts}, got shape {value.shape}")


def selection(block_indices: object, block_counts: object, shapes: Shapes, block: int, cu: jax.Array | None):
    """(block_indices [B, T, HKV, S] int32, block_counts [B, T, HKV] int32) for explicit selection."""
    if block_indices is None:
        raise ValueError("block_indices is required: the pattern selects key blocks explicitly")
    indices = _index_array("block_indices", block_indices)
    if indices.ndim != 4:
        raise ValueError(f"block_indices must be 4-D [batch, seq_len, num_kv_heads, num_selected], got shape {indices.shape}")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"block_indices must be an integer array, got {indices.dtype}")
    if indices.shape[3] < 1:
        raise ValueError(f"block_indices must hold at least one entry per token, got shape {indices.shape}")
    indices = _per_token("block_indices", indices, shapes, block, cu, (indices.shape[3],))
    if isinstance(block_counts, (int, np.integer)) and not isinstance(block_counts, bool):
        count = min(max(int(block_counts), 0), _INT32.max)
        counts = jnp.full((shapes.batch, shapes.query_len, shapes.heads_kv), count, jnp.int32)
    elif not isinstance(block_counts, (jax.Array, np.ndarray, list, tuple)):
        raise ValueError(f"block_counts must be an int or an integer array, got {block_counts!r}")
    else:
        counts = _index_array("block_counts", block_counts)
        if not jnp.issubdtype(counts.dtype, jnp.integer):
            raise ValueError(f"block_counts must be an int or an integer array, got {counts.dtype}")
        if counts.ndim == 0:  # one count for every token, maybe traced
            counts = jnp.broadcast_to(counts, (shapes.batch, shapes.query_len, shapes.heads_kv))
        counts = _per_token("block_counts", counts, shapes, block, cu, ())
    return indices, counts
