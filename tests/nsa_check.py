"""Native Sparse Attention against the float64 reference written from the paper's equations
(tests/nsa_reference.py) on one platform: the kernel's selections by the reference's scores of
the blocks it chose (so exact ties may differ), then outputs and gradients for that selection."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from conftest import (
    assert_close,
    assert_scale_gradient_close,
    gate,
    gradient_floor,
    normal,
    qkv,
)
from nsa_reference import NsaSpec, chosen_scores, nsa_gradients, nsa_reference

import nsa_dsl

# (forward, gradients, selection scores' rtol): float16 kernels round q.k inputs, pooled keys,
# p and ds to float16, so near-tied blocks may swap and their scores differ by that much.
# float64 inputs (jax_enable_x64) are computed in float32 on every platform.
TOLERANCE = {np.float32: (2e-5, 1e-4, 1e-4), np.float16: (5e-3, 5e-3, 2e-2), np.float64: (2e-5, 1e-4, 1e-4)}

def weighted_pool(weights):
    """A learned pooling function: the weighted sum of a compressed block's tokens."""
    return lambda kb, vb: (jnp.einsum("cjhd,j->chd", kb, weights), jnp.einsum("cjhd,j->chd", vb, weights))


def check_against_reference(rng, source, spec, *, batch, seq_len, heads_q, heads_kv, head_dim, dtype=np.float32,
                            cu_seqlens=None, gates=("cmp", "slc", "swa"), softmax_scale=None, config=None,
                            gradients=True, platform="triton", ranked=True):
    """Selections, output and gradients (of q, k, v, the gates, the softmax scale and, with
    spec.pool_weights, the learned pooling's weights) of the pattern `source` on `platform`
    against spec's float64 reference (`gradients=False`: selections and output). `ranked`: some
    row's top-k must leave out a block it could take, else a ranking that ignored the scores
    would pass (random shapes, which may be too short for that, pass False)."""
    forward_tolerance, gradient_tolerance, score_rtol = TOLERANCE[dtype]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    attn = nsa_dsl.compile(source, config=config)
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim, dtype=dtype)
    g = {name: gate(rng, batch, seq_len, heads_q).astype(dtype)
         for name in gates if name != "swa" or spec.window is not None}
    names = sorted(g)
    cu = None if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int32)
    learned = spec.pool_weights is not None
    weights = jnp.asarray(spec.weights(), jnp.float32)

    def options(weights):  # calls with learned pooling are not jitted by nsa_dsl: the test jits them
        pool_fns = {"cmp": weighted_pool(weights)} if learned else None
        return {"cu_seqlens": cu, "platform": platform, "pool_fns": pool_fns}

    def attention(q, k, v, gate_values, weights, scale):
        gate_args = {f"g_{name}": value for name, value in zip(names, gate_values)}
        return attn(q, k, v, softmax_scale=scale, **options(weights), **gate_args)

    # Selection: the kernel's blocks must score like the reference's best (ties may swap ids).
    selections = jax.jit(lambda q, k, v, w: attn.selections(q, k, v, softmax_scale=scale, **options(w)))
    (kernel_chosen,) = selections(q, k, v, weights).values()
    kernel_chosen = np.asarray(kernel_chosen)
    _, _, ref_chosen, scores = nsa_reference(q, k, v, spec, gates=g, scale=scale, cu_seqlens=cu)
    assert not ranked or (np.isfinite(scores).sum(-1) > (ref_chosen >= 0).sum(-1)).any(), (
        "every row selects every block it may take: lengthen the sequence so that the top-k ranks")
    assert ((kernel_chosen >= 0).sum(-1) == (ref_chosen >= 0).sum(-1)).all(), "number of selected blocks"
    got, want = chosen_scores(scores, kernel_chosen), chosen_scores(scores, ref_chosen)
    finite = np.isfinite(want)
    assert (np.isfinite(got) == finite).all(), "a selected block the reference deems invalid"
    np.testing.assert_allclose(got[finite], want[finite], rtol=score_rtol, atol=1e-6)

    # Outputs and gradients for the kernel's (validated) selection.
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates=g, scale=scale, cu_seqlens=cu, selected=kernel_chosen)
    # Not differentiated, the selection kernel writes the gated sum of every branch (its epilogue).
    undifferentiated = jax.jit(attention)(q, k, v, [g[n] for n in names], weights, jnp.float32(scale))
    assert undifferentiated.shape == q.shape and undifferentiated.dtype == q.dtype
    assert_close(undifferentiated, expected, forward_tolerance, "output, not differentiated")
    if not gradients:
        return
    out, pullback = jax.vjp(jax.jit(attention), q, k, v, [g[n] for n in names], weights, jnp.float32(scale))
    assert_close(out, expected, forward_tolerance, "output")

    d_out = normal(rng, *out.shape).astype(dtype)
    dq, dk, dv, dgates, d_weights, d_scale = pullback(jnp.asarray(d_out))
    wanted = nsa_gradients(q, k, v, spec, g, kernel_chosen, d_out, scale=scale, cu_seqlens=cu)
    floor = gradient_floor(wanted["q"], wanted["k"], wanted["v"])
    for name, actual in (("q", dq), ("k", dk), ("v", dv), *(("g_" + n, dg) for n, dg in zip(names, dgates))):
        assert actual.dtype == q.dtype
        assert_close(actual, wanted[name], gradient_tolerance, f"d{name}", least=floor)

    # The scale and learned weights against central differences of the reference, for the
    # kernel's selection.
    def loss(weights, scale):
        weighted = replace(spec, pool_weights=tuple(weights)) if learned else spec
        out = nsa_reference(q, k, v, weighted, gates=g, scale=scale, cu_seqlens=cu, selected=kernel_chosen)[0]
        return np.sum(out * d_out)

    step, w = 1e-4, spec.weights()
    numeric = (loss(w, scale + step) - loss(w, scale - step)) / (2 * step)
    assert_scale_gradient_close(d_scale, numeric, q, wanted["q"], scale, gradient_tolerance)
    if learned:
        numeric = [(loss(w + step * e, scale) - loss(w - step * e, scale)) / (2 * step) for e in np.eye(len(w))]
        assert_close(d_weights, np.array(numeric), gradient_tolerance, "d pooling weights")


def rising_keys(rng, batch, seq_len, heads_q, heads_kv, head_dim, rise):
    """Fresh q, k, v (float32) whose scores rise along the sequence: every query leans on one
    random direction u and key row t adds (t / seq_len) times a multiple of u, so that a query's
    scores against the compressed keys climb by about `rise` (natural log units) from the first
    to the last key of the sequence. An online softmax over compressed keys in several steps then
    finds a new maximum at almost every step, and a step that skipped rescaling what it had summed
    (or counted a key its row does not see yet, which scores higher still) shows."""
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    u = rng.standard_normal(head_dim)
    u /= np.linalg.norm(u)
    lean = 3.0
    climb = rise * np.sqrt(head_dim) / lean * (np.arange(seq_len) / seq_len)
    q = (q + lean * u).astype(np.float32)
    k = (k + climb[None, :, None, None] * u).astype(np.float32)
    return q, k, v


def compression_source(block, stride):
    """The pattern check_compression_against_reference compiles: one compression branch, gated by g_cmp."""
    return f"pattern p\nblock 16\ncausal\nbranch cmp = compress(block={block}, stride={stride}) gate g_cmp\n"


def check_compression_against_reference(rng, *, block, stride, batch, seq_len, heads_q, heads_kv, head_dim,
                                        cu_seqlens=None, platform="triton", config=None, rise=8.0):
    """A pattern of one compression branch, compress(block, stride) gated by g_cmp, on `platform`:
    its output (differentiated and not) and the gradients of q, k, v and g_cmp against the float64
    dense reference (nsa_reference: its o_cmp, and nsa_gradients' dense pooling and visibility),
    on rising_keys inputs. Returns nothing; fails on the first quantity out of tolerance."""
    forward_tolerance, gradient_tolerance, _ = TOLERANCE[np.float32]
    attn = nsa_dsl.compile(compression_source(block, stride), config=config)
    q, k, v = rising_keys(rng, batch, seq_len, heads_q, heads_kv, head_dim, rise)
    g_cmp = gate(rng, batch, seq_len, heads_q)
    cu = None if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int32)
    spec = NsaSpec(compress_block=block, compress_stride=stride, select_count=1, select_block=16)

    attention = jax.jit(lambda q, k, v, g: attn(q, k, v, g_cmp=g, cu_seqlens=cu, platform=platform))
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates={"cmp": g_cmp}, cu_seqlens=cu)
    undifferentiated = attention(q, k, v, g_cmp)
    assert undifferentiated.shape == q.shape and undifferentiated.dtype == q.dtype
    assert_close(undifferentiated, expected, forward_tolerance, "output, not differentiated")
    out, pullback = jax.vjp(attention, q, k, v, g_cmp)
    assert_close(out, expected, forward_tolerance, "output")

    d_out = normal(rng, *q.shape)
    dq, dk, dv, dg = pullback(jnp.asarray(d_out))
    no_selection = np.full((batch, seq_len, heads_kv, 1), -1)
    wanted = nsa_gradients(q, k, v, spec, {"cmp": g_cmp}, no_selection, d_out, cu_seqlens=cu)
    floor = gradient_floor(wanted["q"], wanted["k"], wanted["v"])
    for name, actual in (("q", dq), ("k", dk), ("v", dv), ("g_cmp", dg)):
        assert actual.dtype == q.dtype
        assert_close(actual, wanted[name], gradient_tolerance, f"d{name}", least=floor)
