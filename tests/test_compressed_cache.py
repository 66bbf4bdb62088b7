"""Decoding with a compressed cache (SparseAttention.compress, compressed=): a step reads the
compressed keys the caller keeps instead of pooling the whole key/value cache again.

Decoding loops that write one key row at a time into a cache holding random stale rows, update
the compressed cache by new_rows, and attend the new query, against the float64 reference of
the paper's equations on the whole sequence (selections by the reference's scores of the chosen
blocks, outputs for those selections), on every backend (XLA natively, Triton and Pallas in
their interpreters); the incrementally kept cache against one built at once;
gradients through a cache built inside the differentiated function; learned pooling; bad input;
another pattern's cache refused by its record of how it pooled, which JAX's transformations keep.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import AS_USERS_COMPILE, FORWARD_TOLERANCE, assert_close, gate, qkv
from nsa_reference import chosen_scores, compressed_kv, nsa_gradients, nsa_reference, small_example

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.runtime import compressed_cache, dispatch, triton_glue, xla_engine

NAMES = ("cmp", "slc", "swa")


@pytest.fixture(autouse=True)
def _float32_products():
    """XLA on a GPU multiplies float32 as TF32 by default: the float64 comparisons need float32."""
    with jax.default_matmul_precision("float32"):
        yield


def decode(attention, q, k, v, gates, stale, positions, *, platform, cu_seqlens=None, pool_fns=None):
    """Write key rows one at a time into the cache (stale rows past the last written one),
    updating the compressed cache by new_rows=(t, 1), and attend query t at the rows
    `positions`. Returns the outputs and selections of those rows and the final compressed cache."""
    options = {"cu_seqlens": cu_seqlens, "platform": platform}

    @jax.jit
    def write(k_cache, v_cache, cache, t):
        k_cache, v_cache = (jax.lax.dynamic_update_slice_in_dim(c, jax.lax.dynamic_slice_in_dim(x, t, 1, 1), t, 1)
                            for c, x in ((k_cache, k), (v_cache, v)))
        cache = attention.compress(k_cache, v_cache, cu_seqlens=cu_seqlens, pool_fns=pool_fns, cache=cache,
                                   new_rows=(t, 1))
        return k_cache, v_cache, cache

    @jax.jit
    def step(k_cache, v_cache, cache, t):
        q_t = jax.lax.dynamic_slice_in_dim(q, t, 1, 1)
        gates_t = {f"g_{n}": jax.lax.dynamic_slice_in_dim(g, t, 1, 1) for n, g in gates.items()}
        out = attention(q_t, k_cache, v_cache, query_offset=t, compressed=cache, **options, **gates_t)
        chosen = attention.selections(q_t, k_cache, v_cache, query_offset=t, compressed=cache, **options)["slc"]
        return out, chosen

    k_cache, v_cache = jnp.asarray(stale[0]), jnp.asarray(stale[1])
    cache = attention.compress(k_cache, v_cache, cu_seqlens=cu_seqlens, pool_fns=pool_fns)
    outputs, chosen = {}, {}
    for t in range(max(positions) + 1):
        k_cache, v_cache, cache = write(k_cache, v_cache, cache, jnp.int32(t))
        if t in positions:
            out, picked = step(k_cache, v_cache, cache, jnp.int32(t))
            outputs[t], chosen[t] = np.asarray(out), np.asarray(picked)
    assert write._cache_size() == 1 and step._cache_size() == 1, "one program for every position"
    return outputs, chosen, cache


def check_decoding(rng, platform, *, batch, seq_len, positions, cu_seqlens=None, heads_q=4, heads_kv=2, head_dim=16,
                   config=None):
    source, spec = small_example("nsa")
    attention = nsa_dsl.compile(source, config=config)
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, batch, seq_len, heads_q) for name in NAMES}
    stale = tuple(np.asarray(rng.standard_normal(k.shape), k.dtype) for _ in range(2))
    outputs, chosen, cache = decode(attention, q, k, v, gates, stale, positions, platform=platform,
                                    cu_seqlens=cu_seqlens)

    # The cache kept one row at a time is the cache of the whole sequence (up to the rounding of
    # the float32 means, which XLA may sum in another order inside another program).
    whole = attention.compress(k, v, cu_seqlens=cu_seqlens)
    for name, (k_cmp, v_cmp) in whole.items():
        np.testing.assert_allclose(np.asarray(cache[name][0]), np.asarray(k_cmp), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(cache[name][1]), np.asarray(v_cmp), rtol=1e-6, atol=1e-6)

    _, _, ref_chosen, scores = nsa_reference(q, k, v, spec, gates=gates, cu_seqlens=cu_seqlens)
    selected = ref_chosen.copy()
    for t in positions:
        row_scores = scores[:, t : t + 1]
        got, want = chosen_scores(row_scores, chosen[t]), chosen_scores(row_scores, ref_chosen[:, t : t + 1])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=f"selection of row {t}")
        selected[:, t : t + 1] = chosen[t]
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates=gates, cu_seqlens=cu_seqlens, selected=selected)
    assert np.abs(expected[:, list(positions)]).max() > 0
    for t in positions:
        assert_close(outputs[t], expected[:, t : t + 1], FORWARD_TOLERANCE, f"{platform}, row {t}")


def test_a_triton_decoding_step_has_no_loops(rng):
    """The glue around a step's Triton kernels compiles to straight-line code: on a GPU each trip
    of a loop is another kernel launch (jnp.searchsorted's default method, a while loop, was 20 of
    a step's 53 kernels; here it leaves 3 loops in the compiled program)."""
    source, _ = small_example("nsa")
    attention = nsa_dsl.compile(source)
    q, k, v = qkv(rng, 3, 75, 4, 2, 16)
    gates = {f"g_{name}": gate(rng, 3, 1, 4) for name in NAMES}

    def step(q_new, k_cache, v_cache, cache, positions):
        cache = attention.compress(k_cache, v_cache, cache=cache, new_rows=(positions, 1))
        return attention(q_new, k_cache, v_cache, query_offset=positions, compressed=cache, platform="triton",
                         **gates)

    positions = jnp.asarray([74, 40, 16], jnp.int32)
    lowered = jax.jit(step).lower(q[:, :1], k, v, attention.compress(k, v), positions)
    program = lowered.compile(AS_USERS_COMPILE).as_text()
    assert " while(" not in program


# Primitives that move or reshape an array's elements without computing with them.
_LAYOUT_PRIMITIVES = {"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "concatenate",
                      "copy"}
# A Triton launch: through jax-triton on a GPU, in Triton's interpreter inside a callback on the CPU.
_LAUNCH_PRIMITIVES = {"triton_kernel_call", "pure_callback"}


def launches_reading(jaxpr, sources) -> list[bool]:
    """For each Triton launch of `jaxpr` (nested calls included) that reads one of `sources` (its
    variables), moved or reshaped on the way or not: whether it reads one converted to another
    dtype. A source computed with (a product, a sum) is no longer followed."""
    def follow(jaxpr, reached):  # reached: variable -> whether converted on the way
        readers = []
        for eqn in jaxpr.eqns:
            inputs = [None if isinstance(var, jax.extend.core.Literal) else reached.get(var) for var in eqn.invars]
            name = eqn.primitive.name
            if name in _LAUNCH_PRIMITIVES and any(x is not None for x in inputs):
                readers.append(any(inputs))
            for sub in (x for x in eqn.params.values() if isinstance(x, jax.extend.core.ClosedJaxpr)):
                if len(sub.jaxpr.invars) == len(eqn.invars):  # a call: its arguments are the equation's
                    readers += follow(sub.jaxpr, {v: x for v, x in zip(sub.jaxpr.invars, inputs) if x is not None})
            if name in _LAYOUT_PRIMITIVES | {"convert_element_type"} and any(x is not None for x in inputs):
                converted = name == "convert_element_type" or any(inputs)
                reached.update({var: converted for var in eqn.outvars})
        return readers

    return follow(jaxpr, {var: False for var in sources})


@pytest.mark.parametrize("platform", ["xla", "triton"])
def test_a_half_precision_cache_holds_what_a_call_pools(rng, platform):
    """Keys in float16: the cache is float16 (half the bytes a step reads), and a decoding step of
    three sequences at positions of their own reading it in place outputs exactly what the same
    call outputs pooling the keys itself, which rounds the pooled keys to float16 too. The Triton
    kernels read the float16 gates as they are: no conversion of them runs before the kernels
    (on a GPU, each is another small kernel of the step)."""
    source, _ = small_example("nsa")
    attention = nsa_dsl.compile(source)
    q, k, v = (x.astype(np.float16) for x in qkv(rng, 3, 75, 4, 2, 16))
    gates = {f"g_{name}": gate(rng, 3, 1, 4).astype(np.float16) for name in NAMES}
    cache = attention.compress(k, v)
    assert all(x.dtype == jnp.float16 for pair in cache.values() for x in pair)
    positions = jnp.asarray([74, 40, 16], jnp.int32)
    q_new = jnp.take_along_axis(jnp.asarray(q), positions[:, None, None, None], axis=1)
    cached = attention(q_new, k, v, query_offset=positions, compressed=cache, platform=platform, **gates)
    pooled = attention(q_new, k, v, query_offset=positions, platform=platform, **gates)
    if platform == "triton":
        step = jax.make_jaxpr(lambda gates: attention(q_new, k, v, query_offset=positions, compressed=cache,
                                                      platform=platform, **gates))(gates)
        readers = launches_reading(step.jaxpr, step.jaxpr.invars)
        assert readers and not any(readers), f"launches reading a gate, converted or not: {readers}"
    assert np.abs(np.asarray(pooled, np.float32)).max() > 0
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(pooled))


@pytest.mark.parametrize("platform", ["xla", "triton", "pallas"])
def test_decoding_with_a_compressed_cache_against_the_paper_reference(rng, platform):
    """Two batch rows of 75 tokens (not a whole number of blocks); rows before the first
    compressed key is complete (3), on block edges (15, 16), the last (74)."""
    check_decoding(rng, platform, batch=2, seq_len=75, positions=(3, 15, 16, 40, 74))


@pytest.mark.parametrize("platform", ["xla", "triton", "pallas"])
def test_decoding_sequences_at_positions_of_their_own(rng, platform):
    """Continuous batching: three sequences of a cache of 75 rows decode at positions of their
    own (query_offset and new_rows one per batch row, traced; one program for every step), from
    rows before the first compressed key is complete to the last row; each row's output and
    selection are the paper reference's at its position, and the kept cache is the one built
    from the rows each sequence has written."""
    source, spec = small_example("nsa")
    attention = nsa_dsl.compile(source)
    batch, seq_len, heads_q, heads_kv, head_dim = 3, 75, 4, 2, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, batch, seq_len, heads_q) for name in NAMES}
    first = np.array([2, 30, 61])  # each sequence's position at the first step: its prompt's length
    steps = 14
    written = np.arange(seq_len)[None, :, None, None] < first[:, None, None, None]
    k_cache, v_cache = (jnp.asarray(np.where(written, x, rng.standard_normal(x.shape).astype(x.dtype))) for x in (k, v))
    cache = attention.compress(k_cache, v_cache)

    @jax.jit
    def step(k_cache, v_cache, cache, t):
        def row(x, t):
            return jax.lax.dynamic_slice_in_dim(x, t, 1, 0)

        k_cache, v_cache = (jax.vmap(lambda c, x, t: jax.lax.dynamic_update_slice_in_dim(c, row(x, t), t, 0))(c, x, t)
                            for c, x in ((k_cache, k), (v_cache, v)))
        cache = attention.compress(k_cache, v_cache, cache=cache, new_rows=(t, 1))
        q_t = jax.vmap(row)(q, t)
        gates_t = {f"g_{n}": jax.vmap(row)(g, t) for n, g in gates.items()}
        out = attention(q_t, k_cache, v_cache, query_offset=t, compressed=cache, platform=platform, **gates_t)
        chosen = attention.selections(q_t, k_cache, v_cache, query_offset=t, compressed=cache, platform=platform)
        return k_cache, v_cache, cache, out, chosen["slc"]

    _, _, ref_chosen, scores = nsa_reference(q, k, v, spec, gates=gates)
    outputs, selections = [], []
    for s in range(steps):
        k_cache, v_cache, cache, out, chosen = step(k_cache, v_cache, cache, jnp.asarray(first + s, jnp.int32))
        outputs.append(np.asarray(out)[:, 0])
        selections.append(np.asarray(chosen)[:, 0])
    assert step._cache_size() == 1, "one program for every step"

    rows = np.arange(batch)
    positions = first[:, None] + np.arange(steps)[None, :]  # [batch, steps]
    selected = ref_chosen.copy()
    for s in range(steps):
        at = (rows, positions[:, s])
        np.testing.assert_allclose(chosen_scores(scores[at][:, None], selections[s][:, None]),
                                   chosen_scores(scores[at][:, None], ref_chosen[at][:, None]),
                                   rtol=1e-4, atol=1e-6, err_msg=f"step {s}")
        selected[at] = selections[s]
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates=gates, selected=selected)
    for s in range(steps):
        assert_close(np.stack(outputs)[s], expected[rows, positions[:, s]], FORWARD_TOLERANCE, f"{platform}, step {s}")

    built = attention.compress(k_cache, v_cache)  # the rows each sequence has written, stale rows past them
    for name in built:
        for part, whole in zip(cache[name], built[name]):
            np.testing.assert_allclose(np.asarray(part), np.asarray(whole), rtol=1e-6, atol=1e-6)


def triton_decoding_launches(rng, monkeypatch, constants, *, config=None, **decoding):
    """check_decoding on the Triton platform (3 sequences of 600 tokens, 4 query heads, 2 KV heads),
    the generated module's `constants` set first: its launches, (kernel name, grid, constexprs)."""
    source, _ = small_example("nsa")
    module = codegen.load_module("triton", nsa_dsl.compile(source, config=config).plan, dispatch.for_device(config))
    for name, value in constants.items():
        monkeypatch.setattr(module, name, value)
    launches = []
    launch = triton_glue.launch

    def recording(kernel, grid, *args, **constexprs):
        launches.append((kernel.__name__, tuple(grid), constexprs))
        return launch(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(triton_glue, "launch", recording)
    dispatch.kernel.cache_clear()
    jax.clear_caches()
    try:
        check_decoding(rng, "triton", batch=3, seq_len=600, heads_q=4, heads_kv=2, config=config, **decoding)
    finally:  # no later test may reuse a kernel traced with the constants
        dispatch.kernel.cache_clear()
        jax.clear_caches()
    return launches


def test_triton_decoding_splits_the_walks_over_keys(rng, monkeypatch):
    """A decoding step's few programs split the compression's and the top-k's walks over long
    sequences' keys into shares (3 sequences of 600 tokens, 16 keys a step: 2 shares of each
    sequence's 151 compressed keys, 3 of the top-k's 38 blocks), and the window's 24 keys (2 steps,
    in shares of NEAR_MIN_SPLIT_STEPS = 1 step here), combined as one walk would have: the
    reference's output. The compression's tiles hold one sequence's query (its group's 2
    heads, padded to tl.dot's 16 rows) rather than all three, whose walk would cover all three
    sequences' keys, each share a third of them; the top-k's tiles one query group (not 4, of
    which 3 would hold no query), padded the same way."""
    launches = triton_decoding_launches(rng, monkeypatch, {"NEAR_MIN_SPLIT_STEPS": 1}, positions=(120, 377, 599),
                                        config=nsa_dsl.NativeSparseAttentionConfig(block_k=16))
    grids = {grid for name, grid, _ in launches if name == "compression_forward"}
    assert grids == {(3, 2, 2)}, grids
    window = {grid[2] for name, grid, _ in launches if name.startswith("static_forward")}
    assert window == {2}, window
    topk = {(grid[1:], c["GROUPS"], c["GROUP_SLOTS"]) for name, grid, c in launches if name == "topk_selection"}
    assert topk == {((2, 3), 1, 16)}, topk  # 3 shares, tiles of 1 group of 16 head slots
    # The top-k's shares merge in a kernel (not a sort)
    assert {c["SPLITS"] for name, _, c in launches if name == "topk_merge"} == {3}


def test_triton_decoding_widens_the_compression_steps_where_the_walk_still_fills_the_programs(rng, monkeypatch):
    """A decoding step's compression forward takes wider steps than CMP_STEP_KEYS where its walk
    still splits into shares for SPLIT_PROGRAMS programs (here 12, shares of at least 1 step: 3
    sequences x 2 KV heads = 6 tiles of 151 compressed keys take steps of 64 keys, 2 shares each;
    128 would leave one share a tile), the reference's output all the same."""
    launches = triton_decoding_launches(rng, monkeypatch, {"SPLIT_PROGRAMS": 12, "MIN_SPLIT_STEPS": 1},
                                        positions=(377, 599))
    steps = {(grid, c["STEP"]) for name, grid, c in launches if name == "compression_forward"}
    assert steps == {((3, 2, 2), 64)}, steps


def test_xla_decoding_gathers_only_the_blocks_it_reads(rng, monkeypatch):
    """A decoding step's few query tiles (of 1 row) and tokens read a few key blocks of long
    sequences: the XLA engine gathers those (xla_engine._compacted) instead of transposing all
    keys. Two batch rows (two items of every branch); output and gradients of q, k, v against
    the float64 reference, at rows on a block edge and off one."""
    source, spec = small_example("nsa")
    attention = nsa_dsl.compile(source)
    compactions = []
    real = xla_engine._compacted
    monkeypatch.setattr(xla_engine, "_compacted", lambda *args: compactions.append(1) or real(*args))
    batch, seq_len, heads_q, heads_kv, head_dim = 2, 600, 4, 2, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, batch, seq_len, heads_q) for name in NAMES}
    _, _, ref_chosen, scores = nsa_reference(q, k, v, spec, gates=gates)
    for t in (320, 599):
        rows = slice(t, t + 1)
        row_gates = {f"g_{n}": g[:, rows] for n, g in gates.items()}
        chosen = np.asarray(attention.selections(q[:, rows], k, v, query_offset=t, platform="xla")["slc"])
        np.testing.assert_allclose(chosen_scores(scores[:, rows], chosen),
                                   chosen_scores(scores[:, rows], ref_chosen[:, rows]), rtol=1e-4, atol=1e-6)
        selected = ref_chosen.copy()
        selected[:, rows] = chosen
        expected, _, _, _ = nsa_reference(q, k, v, spec, gates=gates, selected=selected)
        d_out = np.zeros_like(q)
        d_out[:, rows] = rng.standard_normal((batch, 1, heads_q, head_dim))
        wanted = nsa_gradients(q, k, v, spec, gates, selected, d_out)
        out, pullback = jax.vjp(
            lambda q_row, k, v: attention(q_row, k, v, query_offset=t, platform="xla", **row_gates), q[:, rows], k, v)
        assert_close(out, expected[:, rows], FORWARD_TOLERANCE, f"row {t}")
        dq, dk, dv = pullback(jnp.asarray(d_out[:, rows]))
        assert_close(dq, wanted["q"][:, rows], 1e-4, f"dq, row {t}")
        assert_close(dk, wanted["k"], 1e-4, f"dk, row {t}")
        assert_close(dv, wanted["v"], 1e-4, f"dv, row {t}")
    assert compactions, "the step gathered its key blocks"


def test_decoding_packed_sequences_with_a_compressed_cache(rng):
    """Three sequences packed in one row of 90: a sequence's first rows see no compressed key
    of the previous sequence; the cache has a row per sequence more."""
    check_decoding(rng, "xla", batch=1, seq_len=90, positions=(20, 21, 29, 60, 89),
                   cu_seqlens=np.array([0, 21, 50, 90], np.int32))


def test_updating_a_compressed_cache_by_chunks_equals_building_it(rng):
    """new_rows of a prefill chunk (count > 1) across a sequence's end, and of chunks that
    reach the last row: the rows they change, and no others, are recomputed."""
    source, _ = small_example("nsa")
    attention = nsa_dsl.compile(source)
    _, k, v = qkv(rng, 1, 100, 2, 2, 8)
    cu = np.array([0, 33, 40, 100], np.int32)
    stale = tuple(jnp.asarray(rng.standard_normal(k.shape), jnp.float32) for _ in range(2))
    update = jax.jit(lambda kc, vc, cache, first, count: attention.compress(
        kc, vc, cu_seqlens=cu, cache=cache, new_rows=(first, count)), static_argnums=4)
    k_cache, v_cache = stale
    cache = attention.compress(k_cache, v_cache, cu_seqlens=cu)
    build = jax.jit(lambda kc, vc: attention.compress(kc, vc, cu_seqlens=cu))
    for first, count in ((0, 30), (30, 17), (47, 1), (48, 40), (88, 12)):
        rows = slice(first, first + count)
        k_cache, v_cache = k_cache.at[:, rows].set(k[:, rows]), v_cache.at[:, rows].set(v[:, rows])
        cache = update(k_cache, v_cache, cache, jnp.int32(first), count)
        written = build(k_cache, v_cache)
        for name in written:
            for kept, built in zip(cache[name], written[name]):
                np.testing.assert_allclose(np.asarray(kept), np.asarray(built), rtol=1e-6, atol=1e-6,
                                           err_msg=f"after rows {rows}")


def reference_cache(k, v, spec, cu_seqlens, rows):
    """The float64 compressed cache of keys/values [B, T, HKV, D] (nsa_reference.compressed_kv):
    each batch row's sequences' compressed keys one after another, zeros after them, `rows` rows."""
    batch, seq_len, heads_kv, head_dim = k.shape
    bounds = [0, seq_len] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    cache = np.zeros((2, batch, rows, heads_kv, head_dim))
    for b in range(batch):
        row = 0
        for start, end in zip(bounds[:-1], bounds[1:]):
            for h in range(heads_kv):
                k_cmp, v_cmp = compressed_kv(np.asarray(k[b, start:end, h], np.float64),
                                             np.asarray(v[b, start:end, h], np.float64), spec)
                cache[0, b, row:row + len(k_cmp), h], cache[1, b, row:row + len(k_cmp), h] = k_cmp, v_cmp
            row += len(k_cmp)
    return cache


@pytest.mark.parametrize("batch, seq_len, cu_seqlens, chunks", [
    # a chunk of 2 rows from row 7 changes 3 compressed keys (7..8 lie in keys 0, 1 and 2)
    (2, 61, None, (7, 2, 6, 3, 10, 1, 5, 14, 13)),
    # a last chunk of rows 48..54, past the last sequence (52): its first changed row lies
    # fewer than the rows it recomputes before the cache's end
    (1, 55, (0, 13, 21, 52), (7, 2, 6, 3, 10, 1, 5, 14, 7)),
])
def test_prefill_chunks_of_every_size_and_alignment_update_the_paper_reference(rng, batch, seq_len, cu_seqlens, chunks):
    """Prefill chunks (new_rows of 1 to 14 rows, from rows at every offset to the stride) written
    into a cache of stale rows: after each update the compressed cache is the float64 reference's
    pooling of the rows the cache holds (compress(block=8, stride=4))."""
    source, spec = small_example("nsa")
    attention = nsa_dsl.compile(source)
    _, k, v = qkv(rng, batch, seq_len, 2, 2, 8)
    cu = None if cu_seqlens is None else np.asarray(cu_seqlens, np.int32)
    k_cache, v_cache = (rng.standard_normal(k.shape).astype(np.float32) for _ in range(2))
    cache = attention.compress(k_cache, v_cache, cu_seqlens=cu)
    update = jax.jit(lambda kc, vc, cache, first, count: attention.compress(
        kc, vc, cu_seqlens=cu, cache=cache, new_rows=(first, count)), static_argnums=4)
    first = 0
    for count in chunks:
        k_cache[:, first:first + count], v_cache[:, first:first + count] = k[:, first:first + count], v[:, first:first + count]
        cache = update(k_cache, v_cache, cache, jnp.int32(first), count)
        wanted = reference_cache(k_cache, v_cache, spec, cu_seqlens, cache["cmp"][0].shape[1])
        for part, kept, want in zip("kv", cache["cmp"], wanted):
            np.testing.assert_allclose(np.asarray(kept), want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{part}_cmp after rows [{first}, {first + count})")
        first += count
    assert first == seq_len


def test_building_a_cache_window_by_window_equals_building_it_at_once(rng, monkeypatch):
    """A long cache is pooled a bounded window of rows at a time (POOL_BYTES): windows of 4 rows,
    the last one overlapping its predecessor, give the rows one window gives."""
    attention = nsa_dsl.compile(small_example("nsa")[0])
    _, k, v = qkv(rng, 2, 70, 2, 2, 8)
    whole = attention.compress(k, v)
    monkeypatch.setattr(compressed_cache, "POOL_BYTES", 4 * 2 * 2 * 8 * 2 * 8 * 4)  # 4 rows of blocks of 8
    windows = attention.compress(k, v)
    assert whole["cmp"][0].shape[1] % 4, "a last window that overlaps"
    for built, at_once in zip(windows["cmp"], whole["cmp"]):
        np.testing.assert_allclose(np.asarray(built), np.asarray(at_once), rtol=1e-6, atol=1e-6)


def test_gradients_through_a_compressed_cache_equal_those_of_pooling(rng):
    """A call given the cache computes what it computes without: built inside the differentiated
    function, the cache passes the compress branch's gradients on to k and v (float64 reference)."""
    source, spec = small_example("nsa")
    attention = nsa_dsl.compile(source)
    q, k, v = qkv(rng, 1, 48, 4, 2, 16)
    gates = {name: gate(rng, 1, 48, 4) for name in NAMES}
    chosen = np.asarray(attention.selections(q, k, v, platform="xla")["slc"])

    def loss(q, k, v, d_out):
        out = attention(q, k, v, platform="xla", compressed=attention.compress(k, v),
                        **{f"g_{n}": g for n, g in gates.items()})
        return jnp.sum(out * d_out)

    d_out = rng.standard_normal(q.shape).astype(np.float32)
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, d_out)
    wanted = nsa_gradients(q, k, v, spec, gates, chosen, d_out)
    for name, actual in (("q", dq), ("k", dk), ("v", dv)):
        assert_close(actual, wanted[name], 1e-4, f"d{name}")


def test_learned_pooling_is_kept_in_the_cache(rng):
    """With pool=learned the functions are compress's; calls given the cache need none."""
    source = small_example("nsa")[0].replace("compress(block=8, stride=4)", "compress(block=8, stride=4, pool=learned)")
    attention = nsa_dsl.compile(source)
    q, k, v = qkv(rng, 1, 64, 4, 2, 16)
    weights = jnp.asarray(rng.uniform(0.5, 1.5, 8) / 8, jnp.float32)
    pool_fns = {"cmp": lambda kb, vb: (jnp.einsum("cjhd,j->chd", kb, weights), jnp.einsum("cjhd,j->chd", vb, weights))}
    gates = {f"g_{n}": gate(rng, 1, 64, 4) for n in NAMES}
    cache = attention.compress(k, v, pool_fns=pool_fns)
    pooling = attention(q[:, 50:51], k, v, query_offset=50, pool_fns=pool_fns, platform="xla",
                        **{n: g[:, 50:51] for n, g in gates.items()})
    cached = attention(q[:, 50:51], k, v, query_offset=50, compressed=cache, platform="xla",
                       **{n: g[:, 50:51] for n, g in gates.items()})
    np.testing.assert_allclose(np.asarray(cached), np.asarray(pooling), rtol=1e-5, atol=1e-6)
    mean_cache = nsa_dsl.compile(small_example("nsa")[0]).compress(k, v)
    assert not np.allclose(np.asarray(cache["cmp"][0]), np.asarray(mean_cache["cmp"][0])), "the learned pooling ran"
    with pytest.raises(ValueError, match=r"pool_fns: pattern 'nsa' pools with learned functions in branches \['cmp'\]"):
        attention.compress(k, v)


def test_bad_compressed_caches_are_refused(rng):
    source, _ = small_example("nsa")
    attention = nsa_dsl.compile(source)
    q, k, v = qkv(rng, 2, 40, 4, 2, 16)
    cache = attention.compress(k, v)
    k_cmp, v_cmp = cache["cmp"]
    assert k_cmp.shape == (2, 40 // 4 + 1, 2, 16) and k_cmp.dtype == jnp.float32

    def call(compressed):
        return attention(q[:, 39:], k, v, query_offset=39, compressed=compressed, platform="xla")

    def declared(arrays):
        return nsa_dsl.CompressedCache(arrays, attention.plan)

    window = nsa_dsl.compile("pattern w\nblock 16\ncausal\nbranch swa = window(24)\n")
    for compressed, message in (
        (dict(cache), (r"compressed must be the CompressedCache SparseAttention.compress returns, got dict: a plain "
                       r"mapping carries no record of how its rows were pooled; declare arrays that pattern 'nsa' "
                       r"pooled with nsa_dsl.CompressedCache\(arrays, attention.plan\)")),
        (cache["cmp"], r"compressed must be the CompressedCache SparseAttention.compress returns, got tuple$"),
        (nsa_dsl.CompressedCache({}, window.plan),
         (r"compressed must be the cache SparseAttention.compress returns, \{branch: \(k_cmp, v_cmp\)\} for the "
          r"compress branches \['cmp'\], got \[\]")),
        (declared({"cmp": k_cmp}), r"compressed\['cmp'\] must be a pair \(k_cmp, v_cmp\)"),
        (declared({"cmp": (k_cmp[:, :-1], v_cmp)}),
         (r"compressed\['cmp'\] k_cmp must be float32 \(2, 11, 2, 16\) \(the cache of keys \[batch, seq_len, "
          r"num_kv_heads, head_dim\] = \[2, 40, 2, 16\]\), got float32 \(2, 10, 2, 16\)")),
        (declared({"cmp": (k_cmp, v_cmp.astype(jnp.bfloat16))}), r"v_cmp must be float32 .* got bfloat16"),
    ):
        with pytest.raises(ValueError, match=message):
            call(compressed)
    # A step that forgot its query_offset: the message says what the longer keys need.
    with pytest.raises(ValueError, match=r"key must be \[batch=2, seq_len=1, .* got shape \(2, 40, 2, 16\): fewer "
                                         r"queries than keys \(a decoding step\) need query_offset"):
        attention(q[:, 39:], k, v, compressed=cache, g_cmp=q[:, 39:, :, 0])
    with pytest.raises(ValueError, match=r"cu_seqlens of 2 sequences\), got float32 \(1, 11, 2, 16\)"):
        attention(q[:1], k[:1], v[:1], cu_seqlens=np.array([0, 20, 40]), compressed=attention.compress(k[:1], v[:1]))
    for options, message in (
        ({"new_rows": (3, 1)}, "cache and new_rows go together"),
        ({"cache": cache}, "cache and new_rows go together"),
        ({"cache": cache, "new_rows": 3}, r"new_rows must be a pair \(first, count\) of key rows, got 3"),
        ({"cache": cache, "new_rows": (3, jnp.int32(1))}, "new_rows: count must be an int between 1 and seq_len=40"),
        ({"cache": cache, "new_rows": (38, 3)}, "new_rows: first must be between 0 and seq_len - count = 37, got 38"),
        ({"cache": cache, "new_rows": (1.5, 1)}, "new_rows: first must be an int or an integer scalar array, or an "
                                                 r"integer \[2\] array \(one per batch row\), got 1.5"),
        ({"cache": cache, "new_rows": (np.array([3, 38]), 3)},
         r"new_rows: first must be between 0 and seq_len - count = 37, got \[3, 38\]"),
        ({"cache": cache, "new_rows": (np.zeros(3, np.int32), 1)},
         r"new_rows: first: one row per batch row must have shape \(2,\), got \(3,\)"),
        ({"cache": declared({"cmp": cache["cmp"][0]}), "new_rows": (0, 1)}, r"compressed\['cmp'\] must be a pair"),
        ({"cache": dict(cache), "new_rows": (0, 1)}, "a plain mapping carries no record of how its rows were pooled"),
    ):
        with pytest.raises(ValueError, match=message):
            attention.compress(k, v, **options)
    with pytest.raises(ValueError, match="value must have key's shape"):
        attention.compress(k, v[:, :-1])
    with pytest.raises(ValueError, match=r"CompressedCache: pattern 'nsa' has compress branches \['cmp'\], got arrays "
                                         r"of \['swa'\]"):
        nsa_dsl.CompressedCache({"swa": cache["cmp"]}, attention.plan)
    with pytest.raises(ValueError, match="pattern 'w' has no compress branch"):
        window.compress(k, v)


def test_a_cache_of_another_patterns_branch_is_refused(rng):
    """Patterns whose branch 'cmp' has the same stride but another block, or another pooling,
    give compressed keys of the same shapes and other numbers: a call or an update given the
    other pattern's cache is refused, naming the branch and what differs. A pattern whose
    compress branches pool alike (another window) takes the cache."""
    source, _ = small_example("nsa")
    attention = nsa_dsl.compile(source)
    wider = nsa_dsl.compile(source.replace("compress(block=8, stride=4)", "compress(block=16, stride=4)"))
    learned = nsa_dsl.compile(source.replace("compress(block=8, stride=4)", "compress(block=8, stride=4, pool=learned)"))
    pool_fns = {"cmp": lambda kb, vb: (kb.max(axis=1), vb.max(axis=1))}
    q, k, v = qkv(rng, 2, 40, 4, 2, 16)
    gates = {f"g_{name}": gate(rng, 2, 1, 4) for name in NAMES}
    cache = attention.compress(k, v)
    for other, cache_of_other in ((wider, wider.compress(k, v)), (learned, learned.compress(k, v, pool_fns=pool_fns))):
        for part, same in zip(cache["cmp"], cache_of_other["cmp"]):
            assert part.shape == same.shape and part.dtype == same.dtype, "shapes cannot tell the caches apart"
            assert not np.allclose(np.asarray(part), np.asarray(same)), "the other pattern's cache holds other numbers"

    def call(attention, compressed=None):
        return attention(q[:, 39:], k, v, query_offset=39, compressed=compressed, platform="xla", **gates)

    block = (r"compressed\['cmp'\] was pooled by compress\(block=8, stride=4, pool=mean\), not as pattern 'nsa''s "
             r"branch 'cmp' pools \(compress\(block=16, stride=4, pool=mean\)\): block 8 instead of 16; a compressed "
             r"cache is for the pattern that made it")
    pool = (r"compressed\['cmp'\] was pooled by compress\(block=8, stride=4, pool=mean\), not as pattern 'nsa''s "
            r"branch 'cmp' pools \(compress\(block=8, stride=4, pool=learned\)\): pool mean instead of learned")
    for refused, message in (
        (lambda: call(wider, cache), block),
        (lambda: wider.selections(q[:, 39:], k, v, query_offset=39, compressed=cache, platform="xla"), block),
        (lambda: wider.compress(k, v, cache=cache, new_rows=(39, 1)), block),
        (lambda: call(learned, cache), pool),
        (lambda: learned.compress(k, v, pool_fns=pool_fns, cache=cache, new_rows=(39, 1)), pool),
        (lambda: call(attention, wider.compress(k, v)), "block 16 instead of 8"),
        (lambda: call(attention, learned.compress(k, v, pool_fns=pool_fns)), "pool learned instead of mean"),
    ):
        with pytest.raises(ValueError, match=message):
            refused()
    shorter_window = nsa_dsl.compile(source.replace("window(24)", "window(8)"))
    np.testing.assert_allclose(np.asarray(call(shorter_window, cache)), np.asarray(call(shorter_window)),
                               rtol=1e-6, atol=1e-6)


def test_the_cache_and_its_record_pass_through_jax_transformations(rng):
    """A CompressedCache is a pytree of its arrays with the record as static data: jit arguments
    and results, jax.tree.map, device_put, eval_shape, a scan's carry and shard_map give back a
    CompressedCache with the same record (a wrong pattern's call is still refused), keyed by
    branch name, indexable as {branch: (k_cmp, v_cmp)}."""
    source, _ = small_example("nsa")
    attention = nsa_dsl.compile(source)
    wider = nsa_dsl.compile(source.replace("compress(block=8, stride=4)", "compress(block=16, stride=4)"))
    q, k, v = qkv(rng, 2, 40, 4, 2, 16)
    gates = {f"g_{name}": gate(rng, 2, 1, 4) for name in NAMES}
    cache = attention.compress(k, v)
    record = {"cmp": compressed_cache.Pooling(block=8, stride=4, pool="mean")}
    assert dict(cache.pooling) == record
    mesh = jax.make_mesh((1,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.jit(jax.shard_map(lambda c: jax.tree.map(lambda x: 2 * x, c), mesh=mesh,
                                    in_specs=jax.sharding.PartitionSpec("batch"),
                                    out_specs=jax.sharding.PartitionSpec("batch")))
    transformed = {
        "jit": jax.jit(lambda c: c)(cache),
        "jit, updated inside": jax.jit(lambda k, v, c: attention.compress(k, v, cache=c, new_rows=(5, 3)))(k, v, cache),
        "tree.map": jax.tree.map(lambda x: x + 1, cache),
        "device_put": jax.device_put(cache),
        "eval_shape": jax.eval_shape(attention.compress, k, v),
        "scan": jax.lax.scan(lambda c, _: (jax.tree.map(jnp.negative, c), None), cache, length=2)[0],
        "shard_map": sharded(cache),
    }
    for how, result in transformed.items():
        assert isinstance(result, nsa_dsl.CompressedCache), how
        assert dict(result.pooling) == record, how
        assert [x.shape for x in result["cmp"]] == [x.shape for x in cache["cmp"]], how
    np.testing.assert_array_equal(np.asarray(transformed["shard_map"]["cmp"][1]), 2 * np.asarray(cache["cmp"][1]))
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(cache)[0]]
    assert paths == ["['cmp'][0]", "['cmp'][1]"]
    with pytest.raises(ValueError, match="block 8 instead of 16"):
        wider(q[:, 39:], k, v, query_offset=39, compressed=transformed["jit"], platform="xla", **gates)
    with pytest.raises(ValueError, match="block 8 instead of 16"):  # inside jit: the record is static
        jax.jit(lambda c: wider(q[:, 39:], k, v, query_offset=39, compressed=c, platform="xla", **gates))(cache)


def test_decoding_inside_a_shard_map_over_the_batch_and_heads(rng):
    """A server's own shard_map (batch and heads partitioned, check_vma on) builds the compressed
    cache, updates it by new_rows and attends a step: the outputs of one call over the whole
    sequence. Building it inside shard_map failed in JAX (its fori_loop's zero carry varied over
    no mesh axis, the pooled windows over the keys')."""
    source, _ = small_example("nsa")
    attention = nsa_dsl.compile(source)
    batch, seq_len, heads_q, heads_kv = 2, 37, 4, 2
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, 16)
    gates = {f"g_{name}": gate(rng, batch, seq_len, heads_q) for name in NAMES}
    whole = attention(q, k, v, platform="xla", **gates)
    mesh = jax.make_mesh((1, 1), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rows, heads = jax.sharding.PartitionSpec("dp", None, "tp"), jax.sharding.PartitionSpec("dp")

    def step(q_new, k_cache, v_cache, gates_new, t):
        before = (jnp.arange(seq_len) < t[:, None])[..., None, None]  # the prefill's rows
        cache = attention.compress(jnp.where(before, k_cache, 0), jnp.where(before, v_cache, 0))
        cache = attention.compress(k_cache, v_cache, cache=cache, new_rows=(t, 1))
        return attention(q_new, k_cache, v_cache, query_offset=t, compressed=cache, platform="xla", **gates_new)

    sharded_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(rows, rows, rows, rows, heads), out_specs=rows))
    for t in (3, 20, 36):
        positions = jnp.full((batch,), t, jnp.int32)
        out = sharded_step(q[:, t : t + 1], k, v, {n: g[:, t : t + 1] for n, g in gates.items()}, positions)
        assert_close(out, whole[:, t : t + 1], FORWARD_TOLERANCE, f"row {t}")


def test_the_decoding_example_matches_one_call_over_the_whole_sequence():
    """examples/decode.py (prefill, then a jitted, donating step per token) runs and its decoded
    rows equal one call over the whole sequence."""
    example = Path(__file__).resolve().parent.parent / "examples" / "decode.py"
    result = subprocess.run([sys.executable, str(example), "--prompt", "300", "--new", "5"],
                            capture_output=True, text=True, timeout=600, check=True)
    difference = float(re.search(r"max relative difference (\S+)", result.stdout).group(1))
    assert difference < 1e-5, result.stdout
