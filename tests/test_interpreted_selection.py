"""What the Triton and Pallas backends share when their kernels run interpreted on the CPU:
explicit selection with rows that see nothing (zeros, finite and zero gradients), a traced
softmax scale with its own gradient (at a scale of 0 too, beside XLA), and being used only when
asked for by name."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_dsl
import reference
from conftest import FORWARD_TOLERANCE, GRADIENT_TOLERANCE, assert_close, normal, qkv, random_indices
from nsa_reference import NsaSpec, dense_operators
from nsa_dsl.plan import plan as p
from nsa_dsl.runtime import resolve_platform

PLATFORMS = ["triton", "pallas"]


def selection(platform, q, k, v, indices, counts, scale=None):
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=16)
    return nsa_dsl.native_sparse_attention(
        q, k, v, None, None, indices, counts, None, softmax_scale=scale, platform=platform, cfg=cfg
    )


@pytest.mark.parametrize("platform", PLATFORMS)
def test_nothing_to_attend_gives_zeros_and_zero_gradients(rng, platform):
    q, k, v = qkv(rng, 1, 37, 4, 2, 16)
    indices = random_indices(rng, 1, 37, 2, 3, 16)
    indices[0, :20] = -1  # the first 20 tokens select nothing
    indices[0, 20:25, :, :] = 99  # and these only blocks past their own
    out, pullback = jax.vjp(lambda q, k, v: selection(platform, q, k, v, indices, 3), q, k, v)
    assert np.all(np.asarray(out)[0, :25] == 0.0)
    dq, dk, dv = pullback(jnp.asarray(normal(rng, *q.shape)))
    assert all(np.isfinite(np.asarray(g)).all() for g in (dq, dk, dv))
    assert np.all(np.asarray(dq)[0, :25] == 0.0)
    mask = reference.selection_mask(indices, 3, 16)
    assert_close(out, reference.forward(q, k, v, [mask], [None], 0.25), FORWARD_TOLERANCE, "output")


@pytest.mark.parametrize("platform", ["xla", *PLATFORMS])
def test_rows_that_see_nothing_have_zero_dq_whatever_their_output_gradient(rng, platform):
    """Their output is a constant zero: a NaN or inf in its gradient (a padded row's, say) changes
    no gradient, theirs included (Pallas' dq kernel multiplied it by their zero weights)."""
    q, k, v = qkv(rng, 1, 37, 4, 2, 16)
    indices = random_indices(rng, 1, 37, 2, 3, 16)
    indices[0, 20:25] = -1
    d_out = normal(rng, *q.shape)
    _, pullback = jax.vjp(lambda q, k, v: selection(platform, q, k, v, indices, 3), q, k, v)
    clean = pullback(jnp.asarray(d_out))
    d_out[0, 20, 1, 3], d_out[0, 24, 3, 0] = np.nan, np.inf
    for name, expected, actual in zip(("dq", "dk", "dv"), clean, pullback(jnp.asarray(d_out))):
        # Not bit for bit: on a GPU, XLA's dk/dv scatter-add sums in no fixed order.
        np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.all(np.asarray(clean[0])[0, 20:25] == 0.0)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_traced_softmax_scale_and_its_gradient(rng, platform):
    q, k, v = qkv(rng, 1, 33, 3, 1, 16)
    indices = random_indices(rng, 1, 33, 1, 2, 16)
    mask = reference.selection_mask(indices, 2, 16)
    d_out = normal(rng, *q.shape)

    def loss(q, scale):
        return jnp.sum(selection(platform, q, k, v, indices, 2, scale=scale) * d_out)

    value, (dq, d_scale) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(jnp.asarray(q), jnp.float32(0.3))
    with jax.enable_x64(True):
        q64, k64, v64, d64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v, d_out))

        def reference_loss(q, scale):
            return jnp.sum(reference.attention(q, k64, v64, mask, scale, jnp) * d64)

        want_value, (want_dq, want_d_scale) = jax.value_and_grad(reference_loss, argnums=(0, 1))(q64, 0.3)
    assert abs(float(value) - float(want_value)) <= 1e-4 * abs(float(want_value))
    assert_close(dq, want_dq, GRADIENT_TOLERANCE, "dq")
    assert abs(float(d_scale) - float(want_d_scale)) <= 1e-4 * abs(float(want_d_scale))


# A pattern of each kind of dq kernel beside explicit selection: a static window's (key ranges), a
# static table's, and NSA's compression (its top-k takes every block, so that no tie of the scores
# at scale 0 decides).
ZERO_SCALE_PATTERNS = {
    "window": "pattern zero_scale_window\nblock 16\ncausal\nbranch swa = window(24)\n",
    "table": "pattern zero_scale_table\nblock 16\ncausal\nbranch b = local(1) | random(1, seed=3)\n",
    "nsa": "pattern zero_scale_nsa\nblock 16\ncausal\nbranch cmp = compress(block=8, stride=4)\n"
           "branch slc = topk(3, block=16, score=cmp)\nbranch swa = window(16)\n",
}


@pytest.mark.parametrize("kind", ["selection", *ZERO_SCALE_PATTERNS])
@pytest.mark.parametrize("platform", ["xla", *PLATFORMS])
def test_gradients_at_a_traced_softmax_scale_of_zero(rng, platform, kind):
    """Scores are scale * q.k: at a scale of exactly 0 dq and dk vanish, d loss / d scale (the sum
    over rows of q . sum_j ds_ij k_j) does not. Triton's and Pallas' dq kernels stored dq with the
    scale in it, and d scale divided it out again: 0 where the float64 reference has 12 to 106.
    Explicit selection in groups of 1: Triton sums the parts of dq in XLA; NSA's top-k in groups of
    2: its dq kernel reads the stored score gradients."""
    batch, seq_len, heads_q, heads_kv, head_dim = 1, 40, 2 if kind == "selection" else 4, 2, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    d_out = normal(rng, *q.shape)
    pooled = None
    if kind == "selection":
        indices = random_indices(rng, batch, seq_len, heads_kv, 2, 16)
        masks = [reference.selection_mask(indices, 2, 16)]

        def attention(q, k, v, scale):
            return selection(platform, q, k, v, indices, 2, scale=scale)
    else:
        attn = nsa_dsl.compile(ZERO_SCALE_PATTERNS[kind])
        masks = [reference.static_mask(b.static, 16, True, batch, seq_len)
                 for b in attn.plan.branches if isinstance(b, p.StaticBranch)]
        if kind == "nsa":  # every causally valid block of 16 selected: every key up to the query's
            masks.append(np.tril(np.ones((batch, 1, seq_len, seq_len), bool)))
            pooled = dense_operators(NsaSpec(compress_block=8, compress_stride=4, select_count=3, select_block=16),
                                     batch, seq_len)

        def attention(q, k, v, scale):
            return attn(q, k, v, softmax_scale=scale, platform=platform)

    def loss(q, k, v, scale):
        return jnp.sum(attention(q, k, v, scale) * d_out)

    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*map(jnp.asarray, (q, k, v)), jnp.float32(0))
    with jax.enable_x64(True):

        def reference_loss(q, k, v, scale):
            out = sum(reference.attention(q, k, v, mask, scale, jnp) for mask in masks)
            if pooled is not None:
                pool, visible = pooled
                k_cmp, v_cmp = (jnp.einsum("ct,bthd->bchd", pool, x) for x in (k, v))
                out = out + reference.attention(q, k_cmp, v_cmp, visible, scale, jnp)
            return jnp.sum(out * d_out)

        inputs = (jnp.asarray(x, jnp.float64) for x in (q, k, v, 0.0))
        want_value, wanted = jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1, 2, 3)))(*inputs)
    assert abs(float(value) - float(want_value)) <= 1e-4 * abs(float(want_value))
    dq, dk, dv, d_scale = grads
    assert not np.any(wanted[0]) and not np.any(wanted[1])
    assert not np.any(dq) and not np.any(dk), "dq and dk vanish at scale 0"
    assert_close(dv, wanted[2], GRADIENT_TOLERANCE, "dv")
    assert abs(float(d_scale) - float(wanted[3])) <= 1e-4 * abs(float(wanted[3])), (
        f"d softmax_scale: {float(d_scale):.6g} against {float(wanted[3]):.6g}")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the automatic choice on a CPU")
@pytest.mark.parametrize("platform", PLATFORMS)
def test_runs_on_cpu_only_when_asked_for(platform):
    assert resolve_platform(platform) == platform
    assert resolve_platform(None) == "xla"  # interpreters are for tests, never picked by themselves


def test_triton_without_its_packages_is_never_picked_and_says_what_to_install(monkeypatch):
    """A plain `pip install nsa_dsl` (no `gpu` extra) has neither triton nor jax-triton: on a GPU the
    automatic choice was Triton all the same, whose module then failed every call with
    ModuleNotFoundError, as did asking for it by name."""
    gpu, cpu = (nsa_dsl.NativeSparseAttentionConfig(backend=device) for device in ("gpu", "cpu"))
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # importlib.util.find_spec: not installed
    assert resolve_platform(None, gpu) == "pallas"
    with pytest.raises(ValueError, match=r"platform='triton' is not available: its modules import jax_triton, not installed"
                                         r" here \(pip install 'nsa_dsl\[gpu\]' brings them\); available: pallas, xla"):
        resolve_platform("triton", gpu)
    assert resolve_platform("triton", cpu) == "triton"  # the CPU's interpreter needs triton only
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ValueError, match=r"platform='triton' is not available: its modules import triton, not installed"):
        resolve_platform("triton", cpu)
