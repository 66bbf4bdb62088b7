"""JAX transformations of nsa_dsl's attention beyond jit and grad (every backend's tests check
first-order reverse mode against the float64 reference): vmap over a leading axis and jax.checkpoint
give what the plain calls give; the Triton and Pallas kernels refuse to be differentiated twice with
one clear error (nsa_dsl.runtime.derivatives); XLA's forward over reverse (jax.hessian) and reverse
over reverse (grad of grad) match the float64 reference's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from conftest import assert_close, gate, qkv, random_indices
from nsa_reference import dense_nsa_output, small_example

import nsa_dsl

WINDOW = "pattern local\nblock 16\ncausal\nbranch w = window(21)\n"


def _window_attention_of_one_query_row(attention, q, k, v, row, platform):
    """The loss sum(out ** 2) as a function of q's `row`-th query of head 0."""
    def loss(q_row):
        return (attention(q.at[0, row, 0].set(q_row), k, v, platform=platform) ** 2).sum()
    return loss


@pytest.mark.parametrize("platform", ["triton", "pallas"])
@pytest.mark.parametrize("second", ["grad of grad", "hessian"])
def test_a_second_derivative_of_the_kernels_is_a_clear_error(rng, platform, second):
    attention = nsa_dsl.compile(WINDOW)
    q, k, v = (jnp.asarray(x) for x in qkv(rng, 1, 37, 2, 1, 12))
    loss = _window_attention_of_one_query_row(attention, q, k, v, 30, platform)
    # first order works: the rules run, undifferentiated
    assert np.isfinite(np.asarray(jax.grad(loss)(q[0, 30, 0]))).all()
    twice = jax.grad(lambda x: jax.grad(loss)(x).sum()) if second == "grad of grad" else jax.hessian(loss)
    with pytest.raises(nsa_dsl.SecondDerivativeError, match=f"the {platform} kernels of nsa_dsl have first derivatives"):
        twice(q[0, 30, 0])


@pytest.mark.parametrize("platform", ["triton", "pallas"])
def test_a_second_derivative_of_native_sparse_attention_is_a_clear_error(rng, platform):
    text, _ = small_example("nsa")
    attention = nsa_dsl.compile(text)
    q, k, v = (jnp.asarray(x) for x in qkv(rng, 1, 40, 2, 1, 16))
    gates = {name: jnp.asarray(rng.uniform(size=(1, 40, 2)), jnp.float32) for name in ("g_cmp", "g_slc", "g_swa")}

    def loss(q):
        return (attention(q, k, v, platform=platform, **gates) ** 2).sum()

    with pytest.raises(nsa_dsl.SecondDerivativeError):
        jax.grad(lambda q: jax.grad(loss)(q).sum())(q)


def test_xla_forward_over_reverse_matches_the_reference(rng):
    """jax.hessian of a loss of one query row, through XLA's backward, against the dense float64
    reference's (the XLA backward's while loops run forward mode)."""
    attention = nsa_dsl.compile(WINDOW)
    q, k, v = qkv(rng, 1, 37, 2, 1, 12)
    row = 30
    hessian = jax.hessian(_window_attention_of_one_query_row(attention, *map(jnp.asarray, (q, k, v)), row, "xla"))(
        jnp.asarray(q[0, row, 0])
    )
    mask = reference.static_mask(attention.plan.branches[0].static, 16, True, 1, 37)
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v))

        def reference_loss(q_row):
            out = reference.attention(q64.at[0, row, 0].set(q_row), k64, v64, mask, 12**-0.5, xp=jnp)
            return (out**2).sum()

        expected = np.asarray(jax.hessian(reference_loss)(q64[0, row, 0]))
    assert_close(np.asarray(hessian), expected, 1e-3, "hessian")


def test_xla_forward_over_reverse_through_the_compression_matches_the_reference(rng):
    """jax.hessian in one key row of the NSA pattern, whose compression pools the keys through a
    custom_vjp (layout.pooled_blocks: its backward gathers): its forward rule called the custom_vjp
    function itself, which forward mode refuses, so the Hessian in k or v of any compress branch
    raised JAX's TypeError. The top-k is piecewise constant: the reference takes its selection."""
    batch, seq_len, heads_q, heads_kv, dim, row = 1, 40, 2, 1, 8, 21
    text, spec = small_example("nsa")
    attention = nsa_dsl.compile(text)
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, dim)
    names = [g.name.removeprefix("g_") for g in attention.plan.gates]
    gates = [gate(rng, batch, seq_len, heads_q) for _ in names]

    def loss_of(output, q, k, v, gates):
        return lambda key_row: (output(q, k.at[0, row, 0].set(key_row), v, gates) ** 2).sum()

    def ours(q, k, v, gates):
        return attention(q, k, v, platform="xla", **{f"g_{n}": g for n, g in zip(names, gates)})

    got = jax.hessian(loss_of(ours, *map(jnp.asarray, (q, k, v, gates))))(jnp.asarray(k[0, row, 0]))
    chosen = np.asarray(next(iter(attention.selections(q, k, v, platform="xla").values())))
    dense = dense_nsa_output(spec, names, chosen, batch, seq_len, scale=dim**-0.5)
    with jax.enable_x64(True):
        q64, k64, v64, gates64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), (q, k, v, gates))
        expected = np.asarray(jax.hessian(loss_of(dense, q64, k64, v64, gates64))(k64[0, row, 0]))
    assert_close(np.asarray(got), expected, 1e-3, "hessian in a key row")


@pytest.mark.parametrize("pattern", ["window", "nsa"])
def test_xla_reverse_over_reverse_matches_the_reference(rng, pattern):
    """grad of grad, as a gradient penalty takes it (the squared norm of a loss's gradient in q, k
    and v, differentiated again in q, k, v and the gates), through XLA's forward and backward
    against the dense float64 reference's, at odd T, GQA 2 and head dim 12. The NSA pattern's
    top-k is piecewise constant, so the reference takes the kernel's selection as fixed."""
    batch, seq_len, heads_q, heads_kv, dim = 1, 45, 4, 2, 12
    text, spec = (WINDOW, None) if pattern == "window" else small_example("nsa")
    attention = nsa_dsl.compile(text)
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, dim)
    names = [g.name.removeprefix("g_") for g in attention.plan.gates]
    gates = [gate(rng, batch, seq_len, heads_q) for _ in names]
    weights = rng.standard_normal((batch, seq_len, heads_q, dim)).astype(np.float32)

    def penalty(output):
        def loss(q, k, v, gates):
            return (output(q, k, v, gates) * weights).sum()

        def squared_gradient(q, k, v, gates):
            return sum((d**2).sum() for d in jax.grad(loss, argnums=(0, 1, 2))(q, k, v, gates))

        return jax.jit(jax.grad(squared_gradient, argnums=(0, 1, 2, 3)))

    def ours(q, k, v, gates):
        return attention(q, k, v, platform="xla", **{f"g_{n}": g for n, g in zip(names, gates)})

    got = penalty(ours)(*map(jnp.asarray, (q, k, v)), [jnp.asarray(g) for g in gates])
    if spec is None:
        mask = reference.static_mask(attention.plan.branches[0].static, 16, True, batch, seq_len)

        def dense(q, k, v, gates):
            return reference.attention(q, k, v, mask, dim**-0.5, xp=jnp)
    else:
        chosen = np.asarray(next(iter(attention.selections(q, k, v, platform="xla").values())))
        dense = dense_nsa_output(spec, names, chosen, batch, seq_len, scale=dim**-0.5)
    with jax.enable_x64(True):
        as64 = lambda x: jnp.asarray(x, jnp.float64)
        expected = penalty(dense)(as64(q), as64(k), as64(v), [as64(g) for g in gates])
        expected = jax.tree.map(np.asarray, expected)
    for what, actual, wanted in zip(("q", "k", "v"), got[:3], expected[:3]):
        assert_close(np.asarray(actual), wanted, 1e-4, f"d/d{what} of the squared gradient")
    for name, actual, wanted in zip(names, got[3], expected[3]):
        assert_close(np.asarray(actual), wanted, 1e-4, f"d/dg_{name} of the squared gradient")


@pytest.mark.parametrize("platform", ["xla", "triton", "pallas"])
def test_a_caller_refusing_rank_promotion_gets_what_everyone_gets(rng, platform):
    """jax_numpy_rank_promotion="raise" catches implicit broadcasting in a caller's model code; the
    library broadcasts so itself, and failed under it on every platform (the compression's pooling,
    the XLA kernels, their custom_vjp rules, which JAX traces after the call has returned). Now
    outputs and gradients, packed sequences and explicit selections included, equal the default's."""
    text, _ = small_example("nsa")
    attention = nsa_dsl.compile(text)
    q, k, v = (jnp.asarray(x) for x in qkv(rng, 1, 45, 4, 2, 12))
    gates = {g.name: jnp.asarray(gate(rng, 1, 45, 4)) for g in attention.plan.gates}
    indices = jnp.asarray(random_indices(rng, 1, 45, 2, 3, 16), jnp.int32)
    cu_seqlens = jnp.asarray([0, 17, 45], jnp.int32)

    def results():
        def loss(q, k, v):
            packed = attention(q, k, v, cu_seqlens=cu_seqlens, platform=platform, **gates)
            chosen = nsa_dsl.native_sparse_attention(q, k, v, None, gates["g_slc"], indices, 2, platform=platform)
            return (packed * chosen).sum(), (packed, chosen)

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    expected = results()
    with jax.numpy_rank_promotion("raise"):
        got = results()
    for actual, wanted in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(wanted))


@pytest.mark.parametrize("platform", ["xla", "triton", "pallas"])
def test_vmap_and_checkpoint_give_what_the_plain_calls_give(rng, platform):
    """An ensemble axis in front of the batch (vmap: stacked models, per-example losses), and
    jax.checkpoint recomputing the forward in the backward: outputs and gradients equal those of
    the calls one by one, which the backends' own tests check against the float64 reference."""
    attention = nsa_dsl.compile(WINDOW)
    q_stack = jnp.asarray(np.stack([qkv(rng, 1, 37, 4, 2, 12)[0] for _ in range(3)]))
    _, k, v = (jnp.asarray(x) for x in qkv(rng, 1, 37, 4, 2, 12))
    g = jnp.asarray(rng.uniform(size=(1, 37, 4)), jnp.float32)

    def output(q):
        return attention(q, k, v, platform=platform)

    def loss(q):
        return (output(q) * g[..., None]).sum() + (output(q) ** 2).sum()

    one_by_one = [output(q) for q in q_stack]
    grads = [jax.grad(loss)(q) for q in q_stack]
    assert_close(jax.vmap(output)(q_stack), np.stack(one_by_one), 1e-6, "vmap")
    assert_close(jax.vmap(jax.grad(loss))(q_stack), np.stack(grads), 1e-5, "vmap of grad")
    assert_close(jax.grad(jax.checkpoint(loss))(q_stack[0]), grads[0], 1e-6, "checkpoint")


def test_vmap_on_triton_launches_each_kernel_as_often_for_any_mapped_size(rng, monkeypatch):
    """jax-triton launches have no batching rule, so each ran once per mapped element; a call whose
    arrays all lead with the batch axis now runs once with the mapped axis folded into the batch
    (runtime.batching): vmap, vmap of grad and grad of vmap launch as many kernels for 2 elements
    as for 3, and give what the calls one by one give. Explicit selections and a gate are mapped,
    keys, values and counts are not (their per-element gradients kept apart, or summed by grad)."""
    from nsa_dsl.runtime import triton_glue

    launches = []
    interpret = triton_glue._interpret
    monkeypatch.setattr(triton_glue, "_interpret", lambda *a, **k: launches.append(1) or interpret(*a, **k))
    # A launch binds _interpret when it is traced: traces an earlier test left in JAX's caches (the
    # same kernels at the same shapes) would launch uncounted (seen under pytest-xdist, jax 0.11).
    jax.clear_caches()
    seq_len, heads_q, heads_kv, dim, block = 27, 6, 2, 10, 16
    _, k, v = (jnp.asarray(x) for x in qkv(rng, 1, seq_len, heads_q, heads_kv, dim))
    counts = jnp.asarray(rng.integers(0, 3, (1, seq_len, heads_kv)), jnp.int32)
    weights = jnp.asarray(rng.standard_normal((1, seq_len, heads_q, dim)), jnp.float32)

    def output(q, k, g_slc, indices):
        return nsa_dsl.native_sparse_attention(
            q, k, v, None, g_slc, indices, counts, None, cfg=nsa_dsl.NativeSparseAttentionConfig(block_size=block),
            platform="triton",
        )

    def loss(q, k, g_slc, indices):
        out = output(q, k, g_slc, indices)
        return (out * weights).sum() + (out**2).sum()

    def launched(function, *arguments):
        launches.clear()
        result = jax.block_until_ready(function(*arguments))
        return result, len(launches)

    gradients = jax.grad(loss, argnums=(0, 1, 2))
    transformations = {
        "vmap": jax.vmap(output, in_axes=(0, None, 0, 0)),
        "vmap of grad": jax.vmap(gradients, in_axes=(0, None, 0, 0)),
        "grad of vmap": jax.grad(
            lambda *a: jax.vmap(loss, in_axes=(0, None, 0, 0))(*a).sum(), argnums=(0, 1, 2)
        ),
    }
    q = jnp.asarray(np.stack([qkv(rng, 1, seq_len, heads_q, heads_kv, dim)[0] for _ in range(3)]))
    g_slc = jnp.asarray(np.stack([gate(rng, 1, seq_len, heads_q) for _ in range(3)]))
    indices = jnp.asarray(np.stack([random_indices(rng, 1, seq_len, heads_kv, 3, block) for _ in range(3)]), jnp.int32)
    elements = [(q[i], k, g_slc[i], indices[i]) for i in range(3)]
    # Finished before any count: the third element's calls, dispatched asynchronously, would
    # otherwise launch while the first transformation is counted (seen in CI: ('vmap', 2) == 2).
    one_by_one = jax.block_until_ready(([output(*e) for e in elements], [gradients(*e) for e in elements]))
    launch_counts = {}
    for size in (2, 3):  # the first two elements, then all three
        d_q, d_k, d_g_slc = (np.stack(d) for d in zip(*one_by_one[1][:size]))
        expected = {"vmap": np.stack(one_by_one[0][:size]), "vmap of grad": [d_q, d_k, d_g_slc],
                    "grad of vmap": [d_q, d_k.sum(0), d_g_slc]}  # k is shared: its gradients add up
        for name, transformed in transformations.items():
            got, launch_counts[name, size] = launched(transformed, q[:size], k, g_slc[:size], indices[:size])
            for what, actual, wanted in zip(("q", "k", "g_slc"), jax.tree.leaves(got), jax.tree.leaves(expected[name])):
                assert_close(actual, wanted, 1e-5, f"{name}, d/d{what}" if name != "vmap" else name)
    if not triton_glue.on_gpu():  # the interpreter's launches: jax-triton's are not counted
        for name in transformations:
            assert launch_counts[name, 2] == launch_counts[name, 3] > 0, launch_counts


def test_vmap_on_triton_of_no_elements_of_cotangents_alone_and_twice_differentiated(rng):
    """The folded call's edges: an empty mapped axis gives empty results (no kernel on zero rows);
    jax.jacrev (the cotangents mapped, the inputs not), alone or under a vmap, gives the rows of the
    gradients one by one; jax.hessian through a vmap raises SecondDerivativeError, as without it."""
    attention = nsa_dsl.compile(WINDOW)
    q, k, v = (jnp.asarray(x) for x in qkv(rng, 1, 22, 4, 2, 8))
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def output(q):
        return attention(q, k, v, platform="triton")

    empty = jnp.zeros((0, *q.shape), q.dtype)
    assert jax.vmap(output)(empty).shape == (0, *q.shape)
    assert jax.grad(lambda q: jax.vmap(output)(q).sum())(empty).shape == (0, *q.shape)

    def per_head(q):
        return (output(q) * weights).sum(axis=(0, 1, 3))

    rows = np.stack([jax.grad(lambda q, h=h: per_head(q)[h])(q) for h in range(q.shape[2])])
    assert_close(jax.jacrev(per_head)(q), rows, 1e-6, "jacrev")
    # Under a vmap the forward folds, and jacrev's own vmap then maps the cotangents alone.
    assert_close(jax.vmap(jax.jacrev(per_head))(jnp.stack([q, -q])), np.stack([rows, jax.jacrev(per_head)(-q)]), 1e-6,
                 "vmap of jacrev")
    with pytest.raises(nsa_dsl.SecondDerivativeError):
        jax.hessian(lambda r: jax.vmap(lambda q: (output(q.at[0, 5, 0].set(r)) ** 2).sum())(q[None]).sum())(q[0, 5, 0])


def test_a_symbolic_length_is_a_clear_error():
    """jax.export with a symbolic sequence length: the block tables are built for one length, so it
    cannot be exported; it was a TypeError deep in the tables ("'_DimExpr' object cannot be
    interpreted as an integer")."""
    from jax import export

    attention = nsa_dsl.compile("pattern p\nblock 16\nbranch main = window(20)\n")
    (length,) = export.symbolic_shape("t")
    q = jax.ShapeDtypeStruct((1, length, 2, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, length, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"query must have concrete sizes, got shape \(1, t, 2, 8\)"):
        export.export(jax.jit(attention))(q, kv, kv)
    # A valid selection otherwise, so that the sizes are what is wrong whichever is checked first.
    selection = jax.ShapeDtypeStruct((1, length, 1, 1), jnp.int32)
    with pytest.raises(ValueError, match="query must have concrete sizes"):
        export.export(jax.jit(lambda q, k, v, i: nsa_dsl.native_sparse_attention(q, k, v, None, None, i, 1)))(
            q, kv, kv, selection
        )
