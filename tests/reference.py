"""Independent float64 references for the attention kernels, written from the semantics.

Nothing here reads kernel code: a pattern becomes an explicit boolean token mask per batch row
and KV head ([B, HKV, T, T], query rows, key columns), and attention is dense softmax
attention over that mask. Semantics (see nsa_dsl/dsl/model.py and nsa_dsl/plan/plan.py):

  * sequences: without cu_seqlens every batch row is one sequence; with cu_seqlens [N + 1]
    (B == 1) sequence n is rows [cu[n], cu[n+1]) and positions count from its start. A key
    is visible only from a query of its own sequence; rows past cu[-1] see nothing;
  * static key sets: the pattern oracle's [T, T] mask (nsa_dsl.plan.oracle.token_mask, built
    for the packed length T), cut to each sequence's length;
  * explicit selection: query t sees key s iff s <= t and s's block (s // block) is one of the
    first block_counts entries of t's block_indices row; entries < 0 or > t // block are
    ignored; a repeated entry is still one block;
  * a query that sees no key outputs zeros; branches combine as o = sum_c g_c * o_c.

Forward values come from numpy in float64; gradients from jax in float64 (inside jax's x64
context, so the rest of the test suite stays float32) on the same dense formulation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nsa_dsl.plan import oracle


def segments(batch: int, seq_len: int, cu_seqlens=None) -> list[tuple[int, int, int]]:
    """(batch row, first row, end row) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, seq_len) for b in range(batch)]
    cu = [int(x) for x in np.asarray(cu_seqlens)]
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def static_mask(keys, block_size: int, causal: bool, batch: int, seq_len: int, cu_seqlens=None) -> np.ndarray:
    """[B, 1, T, T]: a static key set (model.KeySet or plan.StaticKeys) on every sequence."""
    pattern = oracle.token_mask(keys, block_size, causal, seq_len)
    mask = np.zeros((batch, 1, seq_len, seq_len), dtype=bool)
    for b, first, end in segments(batch, seq_len, cu_seqlens):
        length = end - first
        mask[b, 0, first:end, first:end] = pattern[:length, :length]
    return mask


def selection_mask(block_indices, block_counts, block_size: int, cu_seqlens=None) -> np.ndarray:
    """[B, HKV, T, T]: explicit per-token selection (block_indices [B, T, HKV, S], block_counts
    an int or [B, T, HKV]), one token at a time."""
    block_indices = np.asarray(block_indices)
    batch, seq_len, heads_kv, _ = block_indices.shape
    counts = np.broadcast_to(np.asarray(block_counts), (batch, seq_len, heads_kv))
    mask = np.zeros((batch, heads_kv, seq_len, seq_len), dtype=bool)
    for b, first, end in segments(batch, seq_len, cu_seqlens):
        for t in range(first, end):
            pos = t - first
            for h in range(heads_kv):
                for block in block_indices[b, t, h, : max(int(counts[b, t, h]), 0)]:
                    if 0 <= block <= pos // block_size:
                        lo = first + block * block_size
                        mask[b, h, t, lo : min(lo + block_size, t + 1)] = True
    return mask


def attention(q, k, v, mask, scale, xp=np):
    """Dense masked attention. q [B, T, HQ, D], k/v [B, T, HKV, D], mask [B, HKV or 1, T, T];
    xp is numpy or jax.numpy."""
    heads_q, heads_kv = q.shape[2], k.shape[2]
    group = heads_q // heads_kv
    k = xp.repeat(k, group, axis=2)
    v = xp.repeat(v, group, axis=2)
    mask = xp.repeat(xp.asarray(mask), group, axis=1) if mask.shape[1] == heads_kv else xp.asarray(mask)
    logits = xp.einsum("bthd,bshd->bhts", q, k) * scale
    row_max = xp.max(xp.where(mask, logits, -xp.inf), axis=-1, keepdims=True, initial=-xp.inf)  # no keys: none seen
    row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    weights = xp.exp(xp.where(mask, logits - row_max, -xp.inf))  # exactly 0 off the mask, grads too
    total = weights.sum(axis=-1, keepdims=True)
    probs = weights / xp.where(total > 0, total, 1.0)
    return xp.einsum("bhts,bshd->bthd", probs, v)


def gated_attention(q, k, v, masks: Sequence, gates: Sequence, scale, xp=np):
    """o = sum_c gates[c] * attention(q, k, v, masks[c]); a gate of None weighs 1."""
    out = 0.0
    for mask, gate in zip(masks, gates):
        branch = attention(q, k, v, mask, scale, xp)
        out = out + (branch if gate is None else gate[..., None] * branch)
    return out


def forward(q, k, v, masks: Sequence, gates: Sequence, scale) -> np.ndarray:
    """The float64 reference output."""
    as64 = lambda x: None if x is None else np.asarray(x, dtype=np.float64)  # noqa: E731
    return gated_attention(as64(q), as64(k), as64(v), masks, [as64(g) for g in gates], float(scale))


def gradients(q, k, v, masks: Sequence, gates: Sequence, scale, d_out) -> dict[str, object]:
    """Float64 cotangents of gated_attention for the output cotangent d_out:
    {"q", "k", "v": arrays, "gates": list with None where the gate is None, "scale": a float}."""
    with jax.enable_x64(True):
        as64 = lambda x: jnp.asarray(np.asarray(x, dtype=np.float64))  # noqa: E731
        present = [i for i, g in enumerate(gates) if g is not None]

        @jax.jit  # one compilation instead of dozens of eager float64 ops
        def cotangents(q, k, v, given, scale, d_out):
            def f(q, k, v, given, scale):
                full = list(gates)
                for i, g in zip(present, given):
                    full[i] = g
                return gated_attention(q, k, v, masks, full, scale, jnp)

            return jax.vjp(f, q, k, v, given, scale)[1](d_out)

        dq, dk, dv, d_given, d_scale = cotangents(as64(q), as64(k), as64(v), [as64(gates[i]) for i in present],
                                                  as64(scale), as64(d_out))
        d_gates: list[np.ndarray | None] = [None] * len(gates)
        for i, g in zip(present, d_given):
            d_gates[i] = np.asarray(g)
        return {"q": np.asarray(dq), "k": np.asarray(dk), "v": np.asarray(dv), "gates": d_gates,
                "scale": float(d_scale)}
