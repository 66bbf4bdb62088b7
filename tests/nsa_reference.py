"""Native Sparse Attention in float64, written from the paper's equations (Yuan et al., 2025),
not from any backend: slow, loop-based, obviously correct on small inputs.

Semantics (nsa_dsl's, see the README's DSL reference), per sequence, for a query at local
position t and query head h of KV group g:
  compress(l, d):  k_c[i] = mean(k[i*d : i*d + l]) (same for v), visible iff i*d + l - 1 <= t;
                   o_cmp = softmax over visible i of q.k_c[i] * scale, times v_c; none -> 0.
  topk(n, l', force, Q):  importance of selection block j = sum_i w(i, j) p_cmp[i], with w the
                   number of d-token units compression block i shares with [j*l', (j+1)*l')
                   (Eq. 9; the identity when l = d = l'); summed over the heads of g and over
                   the Q queries of t's query tile; valid blocks j*l' <= t_last (the tile's last
                   query); the forced blocks (force, in selection-block units relative to
                   t_last // l') always, then the best-scoring valid blocks, lower index first
                   on ties, n in all; o_slc = attention over keys s <= t of those blocks.
  window(w):       o_swa = attention over keys s in (t - w, t].
  o = sum over branches of gate * o_branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class NsaSpec:
    compress_block: int
    compress_stride: int
    select_count: int
    select_block: int
    query_block: int = 1
    # forced(query_selection_block, key_selection_block) -> bool
    forced: Callable[[int, int], bool] = lambda qb, kb: False
    window: int | None = None
    # Per-position pooling weights of a compressed block (the mean when None).
    pool_weights: tuple[float, ...] | None = None

    def weights(self) -> np.ndarray:
        if self.pool_weights is None:
            return np.full(self.compress_block, 1 / self.compress_block)
        return np.asarray(self.pool_weights, dtype=np.float64)


# The reference specs of examples/nsa.nsa (the paper's: global(first=1) | local(2) forced) and
# examples/nsa_meanpool.nsa (each query's own block forced).
PAPER = NsaSpec(compress_block=32, compress_stride=16, select_count=16, select_block=64, window=512,
                forced=lambda qb, kb: kb < 1 or qb - 2 < kb <= qb)
MEANPOOL = NsaSpec(compress_block=64, compress_stride=64, select_count=16, select_block=64,
                   forced=lambda qb, kb: kb == qb)


# The same examples scaled down to blocks of 16 (compress 8/4, top-5, window 24; compress 16/16,
# top-4) for the interpreters, whose programs run in Python.
SMALL_PAPER = NsaSpec(compress_block=8, compress_stride=4, select_count=5, select_block=16, window=24,
                      forced=PAPER.forced)
SMALL_MEANPOOL = NsaSpec(compress_block=16, compress_stride=16, select_count=4, select_block=16, forced=MEANPOOL.forced)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def small_example(name: str) -> tuple[str, NsaSpec]:
    """The source of examples/<name>.nsa ("nsa" or "nsa_meanpool") scaled down, and its spec."""
    text = (EXAMPLES / f"{name}.nsa").read_text().replace("block 64", "block 16")
    if name == "nsa":
        text = text.replace("compress(block=32, stride=16)", "compress(block=8, stride=4)")
        return text.replace("topk(16, block=64", "topk(5, block=16").replace("window(512)", "window(24)"), SMALL_PAPER
    text = text.replace("compress(block=64, stride=64)", "compress(block=16, stride=16)")
    return text.replace("topk(16, block=64", "topk(4, block=16"), SMALL_MEANPOOL


def chosen_scores(scores, chosen):
    """The reference's importance of each chosen block, sorted; -inf for unused entries. Kernels
    may break ties between equal scores differently: compare these, not the ids."""
    picked = np.where(chosen >= 0, np.take_along_axis(scores, np.maximum(chosen, 0), axis=-1), -np.inf)
    return np.sort(picked, axis=-1)


def _segments(total: int, cu_seqlens) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    cu = [int(x) for x in cu_seqlens]
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _softmax_attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float):
    """q [D], keys [N, D], values [N, D] -> (output [D], probabilities [N]); N == 0 -> zeros."""
    if len(keys) == 0:
        return np.zeros(values.shape[-1]), np.zeros(0)
    logits = keys @ q * scale
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return p @ values, p


def compressed_kv(k: np.ndarray, v: np.ndarray, spec: NsaSpec):
    """k, v [L, D] of one sequence and head -> pooled [n_c, D] each."""
    block, stride, w = spec.compress_block, spec.compress_stride, spec.weights()
    length = k.shape[0]
    n_c = (length - block) // stride + 1 if length >= block else 0
    kc = np.array([w @ k[i * stride : i * stride + block] for i in range(n_c)]).reshape(n_c, k.shape[1])
    vc = np.array([w @ v[i * stride : i * stride + block] for i in range(n_c)]).reshape(n_c, v.shape[1])
    return kc, vc


def overlap_weights(n_c: int, n_sel: int, spec: NsaSpec) -> np.ndarray:
    """w[i, j]: d-token units compression block i shares with selection block j."""
    l, d, ls = spec.compress_block, spec.compress_stride, spec.select_block
    w = np.zeros((n_c, n_sel))
    for i in range(n_c):
        for j in range(n_sel):
            shared = min(i * d + l, (j + 1) * ls) - max(i * d, j * ls)
            w[i, j] = max(shared, 0) / d
    return w


def nsa_reference(q, k, v, spec: NsaSpec, *, gates: dict[str, np.ndarray | None], scale: float | None = None,
                  cu_seqlens=None, selected: np.ndarray | None = None):
    """Returns (output [B,T,HQ,D], outputs per branch, selection [B,T,HKV,min(n, ceil(T / block))] (-1 padded),
    scores [B,T,HKV,n_sel] (the importance the selection ranked, -inf where invalid)).

    `selected`, if given, replaces the reference's own choice in the selection branch (tests
    pass a kernel's choice after checking its scores, so near-ties cannot make them flaky)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, total, hq, dim = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    scale = dim**-0.5 if scale is None else scale
    n = spec.select_count
    n_sel_max = -(-total // spec.select_block)
    o_cmp, o_slc, o_swa = (np.zeros_like(q) for _ in range(3))
    chosen = np.full((batch, total, hkv, min(n, n_sel_max)), -1)  # no row has more blocks
    scores = np.full((batch, total, hkv, n_sel_max), -np.inf)

    for b in range(batch):
        for start, end in _segments(total, cu_seqlens):
            length = end - start
            n_sel = -(-length // spec.select_block)
            p_cmp = np.zeros((length, hq, max((length - spec.compress_block) // spec.compress_stride + 1, 0)))
            for h in range(hq):
                g = h // group
                kc, vc = compressed_kv(k[b, start:end, g], v[b, start:end, g], spec)
                for t in range(length):
                    visible = [i for i in range(len(kc)) if i * spec.compress_stride + spec.compress_block - 1 <= t]
                    o_cmp[b, start + t, h], p = _softmax_attend(q[b, start + t, h], kc[visible], vc[visible], scale)
                    p_cmp[t, h, visible] = p
            importance = p_cmp @ overlap_weights(p_cmp.shape[2], n_sel, spec)  # [L, HQ, n_sel]
            for t in range(length):
                tile = t // spec.query_block
                tile_queries = range(tile * spec.query_block, min((tile + 1) * spec.query_block, length))
                t_last = tile_queries[-1]
                for g in range(hkv):
                    score = importance[list(tile_queries)][:, g * group : (g + 1) * group].sum(axis=(0, 1))
                    valid = [j for j in range(n_sel) if j * spec.select_block <= t_last]
                    scores[b, start + t, g, valid] = score[valid]
                    forced = [j for j in valid if spec.forced(t_last // spec.select_block, j)]
                    rest = sorted((j for j in valid if j not in forced), key=lambda j: (-score[j], j))
                    pick = (forced + rest)[:n]
                    chosen[b, start + t, g, : len(pick)] = sorted(pick)
            use = chosen if selected is None else np.asarray(selected)
            for t in range(length):
                for h in range(hq):
                    g = h // group
                    blocks = {int(j) for j in use[b, start + t, g] if 0 <= j <= t // spec.select_block}
                    keys_slc = [s for s in range(t + 1) if s // spec.select_block in blocks]
                    o_slc[b, start + t, h], _ = _softmax_attend(
                        q[b, start + t, h], k[b, start + np.array(keys_slc, dtype=int), g], v[b, start + np.array(keys_slc, dtype=int), g], scale)
                    if spec.window is not None:
                        keys_swa = np.arange(max(0, t - spec.window + 1), t + 1)
                        o_swa[b, start + t, h], _ = _softmax_attend(q[b, start + t, h], k[b, start + keys_swa, g], v[b, start + keys_swa, g], scale)

    branches = {"cmp": o_cmp, "slc": o_slc, "swa": o_swa if spec.window is not None else None}
    out = np.zeros_like(q)
    for name, o in branches.items():
        gate = gates.get(name)
        if o is not None and gate is not None:
            out += np.asarray(gate, dtype=np.float64)[..., None] * o
    return out, branches, chosen, scores


def dense_operators(spec: NsaSpec, batch: int, total: int, cu_seqlens=None):
    """The compression branch as dense matrices: pool [C, T] (row i averages compressed key i's
    tokens) and visible [B, 1, T, C] (query t sees compressed key i), over all sequences."""
    pool_rows, owners = [], []
    for start, end in _segments(total, cu_seqlens):
        length = end - start
        for i in range((length - spec.compress_block) // spec.compress_stride + 1 if length >= spec.compress_block else 0):
            row = np.zeros(total)
            row[start + i * spec.compress_stride : start + i * spec.compress_stride + spec.compress_block] = spec.weights()
            pool_rows.append(row)
            owners.append((start, end, i))
    pool = np.array(pool_rows).reshape(len(pool_rows), total)
    visible = np.zeros((batch, 1, total, len(owners)), dtype=bool)
    for c, (start, end, i) in enumerate(owners):
        for t in range(start, end):
            visible[:, 0, t, c] = i * spec.compress_stride + spec.compress_block - 1 <= t - start
    return pool, visible


def dense_nsa_output(spec: NsaSpec, names, chosen, batch: int, total: int, *, scale: float, cu_seqlens=None):
    """The NSA output as a jax.numpy function output(q, k, v, gates) of the branches `names` (gates
    in that order) for a fixed selection `chosen` [B, T, HKV, n] (selection is not differentiated),
    through dense formulations; call it under jax.enable_x64 with float64 arrays."""
    import jax.numpy as jnp
    import reference

    from nsa_dsl.dsl import model

    pool, cmp_visible = dense_operators(spec, batch, total, cu_seqlens)
    masks = {"cmp": cmp_visible, "slc": reference.selection_mask(chosen, spec.select_count, spec.select_block, cu_seqlens)}
    if spec.window is not None:
        masks["swa"] = reference.static_mask(model.Window(spec.window), spec.select_block, True, batch, total, cu_seqlens)

    def output(q, k, v, gates):
        out = 0.0
        for name, gate in zip(names, gates):
            if name == "cmp":
                kc, vc = (jnp.einsum("ct,bthd->bchd", jnp.asarray(pool, jnp.float64), x) for x in (k, v))
                branch = reference.attention(q, kc, vc, masks[name], scale, jnp)
            else:
                branch = reference.attention(q, k, v, masks[name], scale, jnp)
            out = out + gate[..., None] * branch
        return out

    return output


def nsa_gradients(q, k, v, spec: NsaSpec, gates: dict[str, np.ndarray | None], chosen, d_out, *, scale=None, cu_seqlens=None):
    """Float64 cotangents {q, k, v, g_<branch>...} of the NSA output for a fixed selection
    `chosen` [B, T, HKV, n] (selection is not differentiated), through dense formulations."""
    import jax
    import jax.numpy as jnp

    batch, total, _, dim = np.shape(q)
    names = [name for name in ("cmp", "slc", "swa") if gates.get(name) is not None and (name != "swa" or spec.window is not None)]
    output = dense_nsa_output(spec, names, chosen, batch, total, scale=dim**-0.5 if scale is None else scale,
                              cu_seqlens=cu_seqlens)
    with jax.enable_x64(True):
        as64 = lambda x: jnp.asarray(np.asarray(x, dtype=np.float64))
        pullback = jax.jit(lambda q, k, v, g, d: jax.vjp(output, q, k, v, g)[1](d))
        dq, dk, dv, dg = pullback(as64(q), as64(k), as64(v), [as64(gates[n]) for n in names], as64(d_out))
        return {"q": np.asarray(dq), "k": np.asarray(dk), "v": np.asarray(dv), **{f"g_{n}": np.asarray(g) for n, g in zip(names, dg)}}
