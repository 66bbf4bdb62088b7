"""The XLA backend's engine: gathered attention over work items (query tiles or single tokens)
with an online softmax and a flash-style backward, the query-tile layout of a (possibly
sharded, packed) batch, and Native Sparse Attention's compression and top-k selection on top of
them.

None of it depends on the pattern, so it is a module that every generated XLA module imports,
not template text pasted into each: the generated module holds only what the pattern and the
kernel config decide, and passes it in (its tile size BLOCK as `Frame.block`, its working-set
budget CHUNK_BYTES as the `chunk_bytes` of `schedule` and `compression`, its branches' key
rules as `Schedule.keys_for`).

Inputs are trusted: nsa_dsl.runtime validates them before the generated module calls in.
jit- and grad-safe.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import layout
from .promotion import allowing_rank_promotion

# ---- gathered attention: the machinery every branch kind shares ------------------------------
#
# A branch hands over "work items" (query tiles of a static branch, single tokens of an explicit
# selection), each with R query rows per KV head, and a `keys_for` function naming, per step,
# the key block each item reads and which (query, key) pairs are visible. Keys and values are
# gathered one block per (item, KV head) and shared by the G query heads of the group. Items
# are processed a chunk at a time, key blocks one per step with an online softmax, so the
# working set stays near the module's chunk_bytes at any sequence length; the backward pass is
# flash-attention's, recomputing probabilities from the saved log-sum-exp chunk by chunk.
#
# Queries may be a shard of the rows (context parallelism): a Frame says where they lie among
# the keys, and work items are the tiles/tokens of the query rows only; sequences, tables and
# causality are all in the keys' (absolute) positions.
#
# Shapes: queries [items, HKV, R, G, D]; scores [C, HKV, R, G, block], and `visible`
# broadcastable to them. Keys are kept and gathered transposed ([HKV, D, rows] -> [C, HKV, D,
# block]) so that q.k^T is a plain matrix product: XLA:CPU runs those several times faster
# than products contracting both operands' last dimension. One block per step keeps every
# gather in its natural layout (no transposing copy) and measured fastest.


class Schedule(NamedTuple):
    keys_for: Callable  # (work chunk, step) -> (block starts [C, 1|HKV], visible)
    block: int  # rows per key block
    steps: int  # key blocks per work item at most, one per step
    chunk: int  # work items per chunk (C)
    precision: lax.Precision  # of every product (layout.matmul_precision)
    # Loops of STEPS that reverse mode can transpose: `steps` steps, lax.cond skipping those past a
    # chunk's busiest item's, rather than a while loop of a trip count known on the device only
    # (_transposable_when_differentiated).
    transposable: bool = False


# A work dict may hold STEPS, [items] int: how many of the `steps` key blocks each item reads
# (the first ones). A chunk then runs as many steps as its busiest item, not `steps`: a causal
# table's rows or a compression tile's compressed keys grow along the sequence, so this halves
# their work. Chunks are runs of consecutive items, which need about as many steps as each other.
STEPS = "steps"


def schedule(keys_for, *, items, rows, heads_q, heads_kv, head_dim, steps, block, chunk_bytes, dtype):
    """The chunk size for `items` work items of `rows` query rows, each reading `steps` key blocks,
    that keeps a chunk's float32 working set (gathered keys and values, scores, probabilities)
    near `chunk_bytes`, and the products' precision for keys of `dtype`."""
    per_item = 4 * (
        2 * heads_kv * block * head_dim  # gathered keys and values
        + 4 * heads_q * rows * block  # scores, probabilities and their gradients
        + 4 * heads_q * rows * head_dim  # queries, accumulator and their gradients
    )
    chunk = max(1, min(items, chunk_bytes // per_item))
    chunk = -(-items // -(-items // chunk))  # the same number of chunks, evenly filled
    return Schedule(keys_for, block, max(steps, 1), chunk, layout.matmul_precision(dtype))


def frame(offset, q_len: int, k_len: int, batch: int, block: int) -> Frame:
    """The Frame of a call of `block`-row blocks, its block fitted to the keys (layout.fitted_block)."""
    return Frame(offset, q_len, k_len, batch, layout.fitted_block(block, k_len))


class Frame(NamedTuple):
    """Where the query rows lie among the key rows: batch row b's queries are its keys
    [offset, offset + q_len) -- all of them, unless the queries are one shard of the sequence
    axis (offset may be traced, and may be one per batch row [batch]: sequences decoded at
    positions of their own). Query tiles are `rows` consecutive positions of one sequence
    within one query block of `block` (the pattern's: block tables have a row per block)."""

    offset: jax.Array | int
    q_len: int
    k_len: int
    batch: int
    block: int  # the pattern's block size fitted to k_len (frame()), or to whole groups (grouped())
    group: int = 1  # a tile holds whole groups of this many queries (a top-k per block(Q)); divides block

    @property
    def sharded(self):
        return self.q_len < self.k_len

    @property
    def rows(self) -> int:
        """Query rows per tile: the block, or for fewer queries the smallest divisor of the block
        that holds them and whole groups (a decoding step's single query: 1), so that a tile is
        not mostly rows that hold no query."""
        if self.q_len >= self.block:
            return self.block
        # The divisors in pairs (i, block // i) up to sqrt(block): a walk up to the block itself
        # took minutes for a block of 2**30 rows.
        pairs = ((i, self.block // i) for i in range(1, math.isqrt(self.block) + 1) if self.block % i == 0)
        return min(d for pair in pairs for d in pair if d >= self.q_len and d % self.group == 0)

    def grouped(self, group: int) -> Frame:
        """This frame with tiles of whole groups of `group` queries: its block rounded up to a
        multiple of the group, which the pattern's block is (a block fitted to short keys,
        frame(), may not be)."""
        return self._replace(block=-(-self.block // group) * group, group=group)

    def offset_of(self, batch_rows):
        """The offset of each of `batch_rows` (clamped into the batch)."""
        if jnp.ndim(self.offset) == 0:
            return self.offset
        return jnp.asarray(self.offset)[jnp.clip(batch_rows, 0, self.batch - 1)]

    def key_rows(self):
        """[batch * q_len]: each query row's row in the flattened keys."""
        row = jnp.arange(self.batch * self.q_len)
        batch_row = row // self.q_len
        return batch_row * self.k_len + row % self.q_len + self.offset_of(batch_row)

    def query_rows(self, key_rows):
        """The query row at each of `key_rows` (out of range where the key row has none)."""
        batch_row = key_rows // self.k_len
        return batch_row * self.q_len + key_rows % self.k_len - self.offset_of(batch_row)

    def query_span(self, first_rows):
        """[first, end) key rows of the queries of the batch rows that hold `first_rows`."""
        batch_row = jnp.minimum(first_rows // self.k_len, self.batch - 1)
        first = batch_row * self.k_len + self.offset_of(batch_row)
        return first, first + self.q_len

    def whole(self) -> Frame:
        """The frame of queries at every key row."""
        return Frame(0, self.k_len, self.k_len, self.batch, self.block, self.group)

    def own_rows(self, x):
        """x [batch * k_len, ...] per key row -> [batch * q_len, ...] for this frame's queries."""
        return x[self.key_rows()]


def query_rows(cu_seqlens, frame):
    """layout.Rows of each query row: its sequence's start and end row and its position in it
    (-1 outside every sequence), all in the keys' rows."""
    every = layout.rows(cu_seqlens, frame.batch * frame.k_len)
    return jax.tree.map(lambda x: x[frame.key_rows()], every)


class TilePlacement(NamedTuple):
    first_tile: jax.Array  # [N + 1] id of each sequence's first tile
    first_slot: jax.Array  # [N] that tile's first position // frame.rows


def query_tiles(cu_seqlens, frame):
    """The tiles of frame.rows positions of one sequence that hold query rows, sequence by
    sequence, padded to a static bound; and where each sequence's tiles begin (TilePlacement).
    A tile's positions q_pos [tiles, rows] lie in its query block q_block (rows divides the
    block); those with no query (before q_lo or from q_hi on) see nothing."""
    rows = frame.rows
    num_seqs = cu_seqlens.shape[0] - 1
    starts = cu_seqlens[:-1]
    lengths = jnp.maximum(cu_seqlens[1:] - starts, 0)
    first, end = frame.query_span(starts)
    q_lo = jnp.clip(first - starts, 0, lengths)
    q_hi = jnp.clip(end - starts, q_lo, lengths)
    first_slot = q_lo // rows
    counts = jnp.where(q_hi > q_lo, -(-q_hi // rows) - first_slot, 0)
    # >= sum over sequences of their tiles' count: ceil(rows / tile rows) each, and one more for
    # each batch row's sequence that the shard's first query cuts off mid-tile.
    num_tiles = (frame.batch * frame.q_len + num_seqs * (rows - 1)) // rows + (frame.batch if frame.sharded else 0)
    first_tile = jnp.concatenate([jnp.zeros(1, counts.dtype), jnp.cumsum(counts)])
    tile = jnp.arange(num_tiles)
    seq = jnp.minimum(layout.search_sorted(first_tile[1:], tile, side="right"), num_seqs - 1)
    q_first = (first_slot[seq] + tile - first_tile[seq]) * rows
    tiles = {
        "seq": seq,
        "start": starts[seq],
        "length": lengths[seq],
        "q_block": q_first // frame.block,
        "q_pos": q_first[:, None] + jnp.arange(rows),
        "q_lo": q_lo[seq],
        "q_hi": q_hi[seq],
        "valid": tile < first_tile[-1],
    }
    return tiles, TilePlacement(first_tile, first_slot)


def tile_queries(tiles, q_pos):
    """[C, block] whether each of a chunk of tiles' rows (at positions q_pos) is a query."""
    return tiles["valid"][:, None] & (q_pos >= tiles["q_lo"][:, None]) & (q_pos < tiles["q_hi"][:, None])


def tile_rows(rows, tiles, frame, heads_kv):
    """Per-query rows [N, H, D] of every tile -> [tiles, HKV, frame.rows, H // HKV, D]; rows that
    hold no query are zeros. (The clamped gather reads rows of other sequences there: zeroed, a
    non-finite one neither reaches this sequence's key gradients nor takes their gradients back.)"""
    num_tiles = tiles["start"].shape[0]
    heads, dim = rows.shape[1:]
    index = frame.query_rows(tiles["start"][:, None] + tiles["q_pos"])
    used = tile_queries(tiles, tiles["q_pos"])
    blocks = jnp.where(used[..., None, None], jnp.take(rows, index, axis=0, mode="clip"), jnp.zeros((), rows.dtype))
    return blocks.reshape(num_tiles, frame.rows, heads_kv, heads // heads_kv, dim).transpose(0, 2, 1, 3, 4)


def untile(out, cu_seqlens, placement, frame):
    """[tiles, HKV, frame.rows, ...] per tile -> [queries, HKV, ...] per query row (zeros outside
    every sequence)."""
    rows = frame.rows
    num_tiles, heads_kv = out.shape[:2]
    out = out.swapaxes(1, 2).reshape(num_tiles * rows, heads_kv, *out.shape[3:])
    tokens = query_rows(cu_seqlens, frame)
    tile = placement.first_tile[tokens.seq] + tokens.pos // rows - placement.first_slot[tokens.seq]
    row = tile * rows + tokens.pos % rows
    valid = (tokens.pos >= 0).reshape(-1, *[1] * (out.ndim - 1))
    return jnp.where(valid, jnp.take(out, row, axis=0, mode="clip"), jnp.zeros((), out.dtype))


# One block of `block` consecutive rows per (item, head), addressed by (head, start row):
# from row-major [H, N, D] as [C, H, block, D], from column-major [H, D, N] as [C, H, D, block].
_ROWS = lax.GatherDimensionNumbers(offset_dims=(2, 3), collapsed_slice_dims=(0,), start_index_map=(0, 1))
_COLUMNS = lax.GatherDimensionNumbers(offset_dims=(2, 3), collapsed_slice_dims=(0,), start_index_map=(0, 2))
_COLUMNS_ADD = lax.ScatterDimensionNumbers(update_window_dims=(2, 3), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0, 2))


def _block_index(starts, heads):
    """(head, start row) of every block: starts [C, 1|H] -> [C, H, 2]."""
    starts = jnp.broadcast_to(starts, (starts.shape[0], heads))
    return jnp.stack([jnp.broadcast_to(jnp.arange(heads), starts.shape), starts], axis=-1)


def gather_rows(rows, starts, block):
    """rows [H, N, D] -> [C, H, block, D] float32."""
    heads, _, dim = rows.shape
    blocks = lax.gather(rows, _block_index(starts, heads), _ROWS, (1, block, dim), mode=lax.GatherScatterMode.CLIP)
    return blocks.astype(jnp.float32)


def gather_columns(columns, starts, block):
    """columns [H, D, N] -> [C, H, D, block] float32."""
    heads, dim, _ = columns.shape
    blocks = lax.gather(columns, _block_index(starts, heads), _COLUMNS, (1, dim, block), mode=lax.GatherScatterMode.CLIP)
    return blocks.astype(jnp.float32)


def scatter_add_columns(columns, starts, updates):
    """Adds updates [C, H, D, block] into columns [H, D, N] where gather_columns read them."""
    index = _block_index(starts, columns.shape[0])
    return lax.scatter_add(columns, index, updates, _COLUMNS_ADD, mode=lax.GatherScatterMode.CLIP)


def _filled(inputs, shape, value):
    """A float32 scan carry of `shape` filled with `value`, of the same type as what the inputs
    compute: inside shard_map a carry must vary over the mesh axes its inputs vary over from
    the first step (full_like keeps an array's axes; the sum joins them)."""
    anchor = sum(jnp.zeros_like(x, jnp.float32, shape=()) for x in jax.tree.leaves(inputs))
    return jnp.full_like(anchor, value, shape=shape)


def _scan(body, carry, xs):
    """lax.scan over the leading axis of xs; a single iteration runs inline, with no loop to
    compile or run (the common case for short sequences)."""
    if jax.tree.leaves(xs)[0].shape[0] > 1:
        return lax.scan(body, carry, xs)
    carry, ys = body(carry, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: y[None], ys)


def _steps(sched, step, carry, work):
    """`step(carry, index)` over the key blocks a chunk of work items reads: all of
    sched.steps, or as many as its busiest item's STEPS; one step runs inline."""
    if sched.steps == 1:
        return step(carry, 0)
    count = jnp.minimum(jnp.max(work[STEPS]), sched.steps) if STEPS in work else sched.steps
    if sched.transposable and STEPS in work:  # all steps, those from count on skipped
        return lax.fori_loop(
            0, sched.steps, lambda index, c: lax.cond(index < count, lambda c: step(c, index), lambda c: c, c), carry
        )
    return lax.fori_loop(0, count, lambda index, c: step(c, index), carry)


def _seen_columns(visible):
    """[C, 1|HKV, block]: the key columns of a step's blocks that some query row of the item sees.
    A block may reach past the item's sequence (into the next packed sequence, another batch row,
    or, for an entry that names no block, the first rows), and zero weights alone do not keep a
    non-finite key or value out of a product (0 * inf is NaN): the columns no row sees are zeroed
    before they meet another operand, and their gradients are zeroed before they are added."""
    return jnp.any(visible, axis=(2, 3))


def _chunk_forward(sched, q, keys_t, values, work):
    """One chunk: q [C, HKV, R, G, D] -> (out [C, HKV, R, G, D], lse [C, HKV, R, G])."""

    def step(carry, index):
        running_max, total, acc = carry
        starts, visible = sched.keys_for(work, index)
        k_t = gather_columns(keys_t, starts, sched.block)
        v = jnp.where(_seen_columns(visible)[..., None], gather_rows(values, starts, sched.block), 0.0)
        scores = jnp.where(visible, jnp.einsum("chrgd,chdk->chrgk", q, k_t, precision=sched.precision), -jnp.inf)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        shift = jnp.where(new_max > -jnp.inf, new_max, 0.0)  # rows that have seen no key yet
        p = jnp.exp(scores - shift[..., None])
        rescale = jnp.exp(running_max - shift)
        total = total * rescale + p.sum(axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("chrgk,chkd->chrgd", p, v, precision=sched.precision)
        return new_max, total, acc

    inputs = (q, keys_t, values, work)
    init = (_filled(inputs, q.shape[:-1], -jnp.inf), _filled(inputs, q.shape[:-1], 0.0), _filled(inputs, q.shape, 0.0))
    running_max, total, acc = _steps(sched, step, init, work)
    seen = total > 0  # a row that sees no key outputs zeros
    total = jnp.where(seen, total, 1.0)
    return acc / total[..., None], jnp.where(seen, running_max + jnp.log(total), 0.0)


def _chunk_backward(sched, q, d_out, lse, delta, keys, keys_t, values_t, work, grads):
    """One chunk's dq, and its dk/dv added into grads = (dk_t, dv_t), both [HKV, D, N]. Every
    product is a plain matrix product (see above): dq takes the key blocks as rows, and dk/dv
    take q and d_out transposed, once a chunk, to [C, HKV, D, R*G]."""
    items, heads_kv, rows, group, dim = q.shape
    q_t, d_out_t = (x.reshape(items, heads_kv, rows * group, dim).swapaxes(-1, -2) for x in (q, d_out))

    def step(carry, index):
        dq, (dk_t, dv_t) = carry
        starts, visible = sched.keys_for(work, index)
        seen = _seen_columns(visible)
        k_t = gather_columns(keys_t, starts, sched.block)
        v_t = gather_columns(values_t, starts, sched.block)
        scores = jnp.einsum("chrgd,chdk->chrgk", q, k_t, precision=sched.precision)
        p = jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0)
        dp = jnp.einsum("chrgd,chdk->chrgk", d_out, v_t, precision=sched.precision)
        ds = jnp.where(visible, p * (dp - delta[..., None]), 0.0)
        k = jnp.where(seen[..., None], gather_rows(keys, starts, sched.block), 0.0)
        dq = dq + jnp.einsum("chrgk,chkd->chrgd", ds, k, precision=sched.precision)
        p, ds = (x.reshape(items, heads_kv, rows * group, sched.block) for x in (p, ds))
        dk_block, dv_block = (
            jnp.where(seen[:, :, None, :], jnp.einsum("chdn,chnk->chdk", x_t, y, precision=sched.precision), 0.0)
            for x_t, y in ((q_t, ds), (d_out_t, p))
        )
        dk_t = scatter_add_columns(dk_t, starts, dk_block)
        dv_t = scatter_add_columns(dv_t, starts, dv_block)
        return dq, (dk_t, dv_t)

    dq = _filled((q, d_out, lse, delta, keys_t, values_t, work), q.shape, 0.0)
    return _steps(sched, step, (dq, grads), work)


def _chunks(tree, size):
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // size, size, *x.shape[1:]), tree)


def _unchunk(tree):
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


def _attention_forward(sched, queries, keys_t, values, work):
    _, (out, lse) = _scan(
        lambda _, chunk: (None, _chunk_forward(sched, chunk[0], keys_t, values, chunk[1])),
        None,
        _chunks((queries, work), sched.chunk),
    )
    out, lse = _unchunk((out, lse))
    return out, (queries, keys_t, values, work, out, lse)


def _attention_backward(sched, residuals, d_out):
    queries, keys_t, values, work, out, lse = residuals
    keys, values_t = keys_t.transpose(0, 2, 1), values.transpose(0, 2, 1)
    delta = jnp.sum(d_out * out, axis=-1)

    def one_chunk(grads, chunk):
        q, do, chunk_lse, chunk_delta, chunk_work = chunk
        return _chunk_backward(sched, q, do, chunk_lse, chunk_delta, keys, keys_t, values_t, chunk_work, grads)[::-1]

    zeros = _filled((queries, d_out, keys_t, values, work), keys_t.shape, 0.0)
    (dk_t, dv_t), dq = _scan(one_chunk, (zeros, zeros), _chunks((queries, d_out, lse, delta, work), sched.chunk))
    return _unchunk(dq), dk_t.astype(keys_t.dtype), dv_t.transpose(0, 2, 1).astype(values.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_attention(sched, queries, keys_t, values, work):
    return _attention_forward(sched, queries, keys_t, values, work)[0]


def _transposable_when_differentiated(rule):
    """A custom_vjp rule that runs its while loops, and whose JVP is the JVP of the rule with
    transposable loops (Schedule.transposable). Differentiating the rules happens only for a second
    derivative: jax.hessian runs the JVP, grad of grad transposes it, which a while loop refuses.
    The rules keep their while loops otherwise: the static trip count, with a lax.cond in every step,
    made the forward and backward ~1.3-1.6x slower on an H100 (a conditional's predicate is read on
    the host), though not on a CPU."""
    rule = allowing_rank_promotion(rule)

    @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
    def rule_with_while_loops(sched, *arguments):
        return rule(sched, *arguments)

    @rule_with_while_loops.defjvp
    def rule_jvp(sched, primals, tangents):
        return jax.jvp(functools.partial(rule, sched._replace(transposable=True)), primals, tangents)

    return rule_with_while_loops


_chunked_attention.defvjp(
    _transposable_when_differentiated(_attention_forward), _transposable_when_differentiated(_attention_backward)
)


def gathered_attention(sched, queries, keys, values, work):
    """queries [items, HKV, R, G, D] float32, already scaled; keys/values [N, HKV, D]; work: the
    items' arrays for sched.keys_for (leading dim items) -> [items, HKV, R, G, D] float32."""
    items = queries.shape[0]
    if COMPACT_SHARE * items * sched.steps * sched.block < keys.shape[0]:
        sched, keys, values, work = _compacted(sched, keys, values, work, items)
    padded = -(-items // sched.chunk) * sched.chunk

    def pad(x):  # padding items are zeros: invalid, and see nothing
        return jnp.pad(x, [(0, padded - items)] + [(0, 0)] * (x.ndim - 1))

    # Head-major, with `block` spare rows so that a block starting at any row stays in bounds.
    keys_t = jnp.pad(keys.transpose(1, 2, 0), ((0, 0), (0, 0), (0, sched.block)))
    values = jnp.pad(values.transpose(1, 0, 2), ((0, 0), (0, sched.block), (0, 0)))
    out = _chunked_attention(sched, pad(queries), keys_t, values, jax.tree.map(pad, work))
    return out[:items]


# Where the items read few of the keys (a decoding step's query: a window, some selected blocks),
# transposing all of them would cost more than the attention: items * steps * block rows times
# COMPACT_SHARE below the key count gather them first, block after block, and read that instead.
COMPACT_SHARE = 4


def _compacted(sched, keys, values, work, items):
    """(sched, keys, values, work) reading the key blocks every item reads, gathered into
    [steps * items * block, HKV, D] (item i's block of step s at rows (s * items + i) * block,
    for each head the one it reads), instead of all N keys. A gather: gradients reach keys and
    values by autodiff."""
    heads_kv = keys.shape[1]
    starts = jnp.stack(
        [jnp.broadcast_to(sched.keys_for(work, step)[0], (items, heads_kv)) for step in range(sched.steps)]
    )
    rows = jnp.clip(starts[..., None] + jnp.arange(sched.block), 0, keys.shape[0] - 1)  # [steps, items, HKV, block]
    heads = jnp.arange(heads_kv)[:, None]
    keys, values = (x[rows, heads].transpose(0, 1, 3, 2, 4).reshape(-1, heads_kv, x.shape[-1]) for x in (keys, values))

    def keys_for(chunk, step):
        _, visible = sched.keys_for(chunk, step)
        return ((step * items + chunk[_ITEM]) * sched.block)[:, None], visible

    return sched._replace(keys_for=keys_for), keys, values, {**work, _ITEM: jnp.arange(items)}


_ITEM = "compacted item"


# ---- Native Sparse Attention: compression and top-k selection ---------------------------------
#
# compress(block=l, stride=d): compressed key/value i of a sequence pools its tokens
# [i*d, i*d + l) (their mean, or a learned function the caller passes); a query at t sees it
# once complete (i*d + l - 1 <= t). The compressed keys of all sequences live in one flat
# array, sequence after sequence, so the gathered-attention machinery reads them like any
# other key rows.
# topk(n, block=l', ...): selection block j's importance is the compression probability of the
# compressed blocks overlapping it, each weighted by the d-token units they share (the paper's
# Eq. 9), summed over the query heads of a KV group; the n best causally valid blocks are kept,
# forced blocks first, lower block ids first on ties. Selection is not differentiated:
# gradients reach q, k and v through the branches' outputs.


def compressed_key_blocks(block, cmp_block, cmp_stride, tiles, step):
    """The block of `block` compressed keys each query tile of a chunk reads at `step`, and which
    of its (query, compressed key) pairs are visible (Schedule.keys_for)."""
    index = step * block + jnp.arange(block)  # compressed keys of the tile's sequence
    q_pos = tiles["q_pos"]  # [C, rows]
    q_used = tile_queries(tiles, q_pos)
    complete = index[None, None, :] * cmp_stride + cmp_block - 1 <= q_pos[:, :, None]
    visible = q_used[:, :, None] & (index[None, :] < tiles["cmp_count"][:, None])[:, None, :] & complete
    return (tiles["cmp_first"] + step * block)[:, None], visible[:, None, :, None, :]


def compression(queries, pooled, cu_seqlens, frame, cmp_block, cmp_stride, chunk_bytes):
    """A compress branch's output: queries [Nq, HQ, D] float32 (scaled) attending to the
    compressed keys and values of layout.pool_compressed -> [Nq, HQ, D] float32, a chunk's
    working set near `chunk_bytes` (schedule)."""
    num_queries, heads_q, head_dim = queries.shape
    k_cmp, v_cmp, cmp_offsets = pooled
    heads_kv = k_cmp.shape[1]
    tiles, placement = query_tiles(cu_seqlens, frame)
    tiles["cmp_first"], tiles["cmp_count"] = cmp_offsets[tiles["seq"]], jnp.diff(cmp_offsets)[tiles["seq"]]
    most = max((frame.k_len - cmp_block) // cmp_stride + 1, 1)  # compressed keys of the longest sequence
    block = frame.block
    # A tile reads the blocks of compressed keys complete by its last query.
    last = jnp.minimum(tiles["q_pos"][:, -1], tiles["length"] - 1)
    seen = jnp.clip((last - cmp_block + 1) // cmp_stride + 1, 0, tiles["cmp_count"])
    tiles[STEPS] = jnp.where(tiles["valid"], -(-seen // block), 0)
    sched = schedule(
        functools.partial(compressed_key_blocks, block, cmp_block, cmp_stride),
        items=tiles["start"].shape[0], rows=frame.rows, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
        steps=-(-most // block), block=block, chunk_bytes=chunk_bytes, dtype=k_cmp.dtype,
    )
    out = gathered_attention(sched, tile_rows(queries, tiles, frame, heads_kv), k_cmp, v_cmp, tiles)
    return untile(out, cu_seqlens, placement, frame).reshape(num_queries, heads_q, head_dim)


def selection_scores(q, k_cmp, count, q_pos, length, cmp_block, cmp_stride, sel_block, num_sel, precision):
    """Importance of every selection block for a chunk of query rows.

    q [C, HKV, R, G, D] (scaled), k_cmp [C, HKV, M, D] the rows' compressed keys, count [C] how
    many exist, q_pos [C, R] the rows' positions in sequences of `length` [C] ->
    [C, HKV, R, num_sel] summed over the group's heads; rows past the sequence score 0. `precision`:
    the product's (layout.matmul_precision)."""
    index = jnp.arange(k_cmp.shape[2])
    visible = (
        (index[None, None, :] < count[:, None, None])
        & (index[None, None, :] * cmp_stride + cmp_block - 1 <= q_pos[:, :, None])
        & (q_pos < length[:, None])[:, :, None]
    )  # [C, R, M]
    products = jnp.einsum("chrgd,chmd->chrgm", q, k_cmp, precision=precision)
    scores = jnp.where(visible[:, None, :, None, :], products, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - jnp.where(top > -jnp.inf, top, 0.0))
    # [C, HKV, R, M]: each head's probabilities summed over the group, which shares one selection,
    # as a product with the heads' 1 / sums. Normalising and then reducing the group axis ran ~7-11x
    # slower per tile on XLA:CPU (a middle axis; at 32k tokens the top-k's scores took 1.17 s).
    inverse_sums = 1.0 / jnp.maximum(e.sum(axis=-1), 1e-30)
    p = jnp.einsum("chrgm,chrg->chrm", e, inverse_sums, precision=precision)
    # Compressed block i covers the d-token units i .. i + l/d - 1; selection block j the units
    # j*l'/d .. (j+1)*l'/d - 1.
    per_unit = cmp_block // cmp_stride
    units = sum(jnp.pad(p, [(0, 0)] * 3 + [(shift, per_unit - 1 - shift)]) for shift in range(per_unit))
    units_per_block = sel_block // cmp_stride
    width = num_sel * units_per_block
    units = jnp.pad(units, [(0, 0)] * 3 + [(0, max(width - units.shape[-1], 0))])[..., :width]
    return units.reshape(*units.shape[:3], num_sel, units_per_block).sum(axis=-1)


def top_blocks(scores, last_block, forced, count):
    """The `count` best blocks among 0..last_block per row, forced ones first, lower ids first
    on ties; -1 where fewer exist. scores [..., S] (S >= count: layout.fitted_selection),
    last_block / forced broadcastable -> [..., count]."""
    block = jnp.arange(scores.shape[-1])
    ranked = jnp.where(block <= last_block[..., None], jnp.where(forced, jnp.inf, scores), -jnp.inf)
    best, index = lax.top_k(ranked, count)
    return jnp.where(best > -jnp.inf, index, -1)


def topk_selection(
    queries, pooled, cu_seqlens, frame, forced_table, *, count, cmp_block, cmp_stride, sel_block, query_block,
    chunk_bytes,
):
    """Selected blocks [Nq, HKV, count fitted to the keys] (ids of sel_block-token blocks of
    each query's sequence, -1 unused) from queries [Nq, HQ, D] (scaled) and a compress branch's layout.pool_compressed,
    scoring as many tiles at once as keep their float32 scores near `chunk_bytes`.
    Every query of a `query_block` group must be among the queries (the runtime sees to it)."""
    frame = frame.grouped(query_block)
    rows = frame.rows
    k_cmp, _, cmp_offsets = pooled
    heads_kv = k_cmp.shape[1]
    precision = layout.matmul_precision(k_cmp.dtype)
    tiles, placement = query_tiles(cu_seqlens, frame)
    most = max((frame.k_len - cmp_block) // cmp_stride + 1, 1)
    count, sel_block = layout.fitted_selection(count, sel_block, cmp_stride, frame.k_len)
    num_sel = -(-frame.k_len // sel_block)
    forced_indices, forced_counts = (jnp.asarray(part) for part in forced_table)
    q_tiles = lax.stop_gradient(tile_rows(queries, tiles, frame, heads_kv))
    # [HKV, rows, D], padded so that any sequence's `most` compressed keys can be sliced out.
    k_cmp = jnp.pad(lax.stop_gradient(k_cmp).transpose(1, 0, 2), ((0, 0), (0, most), (0, 0)))

    def one_tile(tile):
        q, q_pos, length, cmp_first, cmp_count = tile
        k = lax.dynamic_slice_in_dim(k_cmp, cmp_first, most, axis=1)
        scores = selection_scores(
            q[None], k[None], cmp_count[None], q_pos[None], length[None], cmp_block, cmp_stride, sel_block, num_sel,
            precision,
        )[0]
        # One selection per `query_block` consecutive queries: their scores add up, and the
        # group's last query (within the sequence) decides which blocks are causally valid.
        scores = scores.reshape(heads_kv, rows // query_block, query_block, num_sel).sum(axis=2)
        group_last = jnp.maximum(jnp.minimum(q_pos.reshape(-1, query_block)[:, -1], length - 1), 0)
        row = jnp.minimum(group_last // sel_block, forced_indices.shape[0] - 1)
        forced_ids = jnp.where(
            jnp.arange(forced_indices.shape[1]) < forced_counts[row][:, None], forced_indices[row], -1
        )
        forced = (jnp.arange(num_sel)[None, :, None] == forced_ids[:, None, :]).any(axis=-1)  # [groups, num_sel]
        chosen = top_blocks(scores, group_last // sel_block, forced[None], count)  # [HKV, groups, count]
        return jnp.repeat(chosen, query_block, axis=1)  # [HKV, rows, count]

    heads = queries.shape[1]
    tile_bytes = 4 * rows * heads * (2 * most + num_sel)  # scores, probabilities, block importances
    chosen = lax.map(
        one_tile,
        (q_tiles, tiles["q_pos"], tiles["length"], cmp_offsets[tiles["seq"]], jnp.diff(cmp_offsets)[tiles["seq"]]),
        batch_size=max(1, min(tiles["start"].shape[0], chunk_bytes // tile_bytes)),
    )
    # Rows outside every sequence select nothing (-1), not block 0.
    return untile(chosen + 1, cu_seqlens, placement, frame) - 1
