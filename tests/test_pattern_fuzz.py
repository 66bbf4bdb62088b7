"""Random patterns, written as .nsa text, against the float64 references on every platform.

Hypothesis draws a pattern and the shapes it runs on (odd lengths, batches or packed sequences
with rows past the last one, GQA groups of 1 to 16, head dims that are no power of two; float32
and float16, and for static patterns and explicit selections bfloat16 too, but on Triton's
interpreter); the pattern goes through the whole pipeline (parse, lower, render, compile). The hand-written tests
pin the cases we thought of; these look for the ones we did not.
- Static patterns (block size, causality, one to three branches of nested key-set algebra over
  every atom kind, gated or not): the output and the gradients of q, k, v, the softmax scale and
  the gates against tests/reference.py, which evaluates the pattern densely from its meaning
  (plan.oracle) and knows nothing of tables, ranges or kernels.
- Native Sparse Attention (compression block and stride, selection block and count, forced
  blocks, `per block(Q)`, a sliding window or none): selections, output and gradients against
  tests/nsa_reference.py, written from the paper's equations (tests/nsa_check.py).
- native_sparse_attention's explicit selections (block size, entries, counts, ids out of range
  and repeated): output and gradients against reference.selection_mask's dense attention.
- A shard of the queries (query_offset) against the whole call, static and NSA patterns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from conftest import (
    assert_close,
    assert_scale_gradient_close,
    gate,
    gradient_floor,
    qkv,
    random_indices,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from nsa_check import check_against_reference
from nsa_reference import NsaSpec
from static_check import TOLERANCE, check_static

import nsa_dsl

# The platforms, and the config each compiles with: Pallas' TPU variant (Mosaic kernels) runs in
# the interpreter too.
TARGETS = {
    "xla": ("xla", None),
    "triton": ("triton", None),
    "pallas": ("pallas", None),
    "pallas-tpu": ("pallas", nsa_dsl.NativeSparseAttentionConfig(backend="tpu")),
}
# Examples a run, per target: the interpreters run every program of a kernel one by one.
EXAMPLES = {"xla": 16, "triton": 6, "pallas": 5, "pallas-tpu": 5}
# The input dtypes drawn per target (Triton's interpreter runs on numpy, which has no bfloat16).
DTYPES = {"xla": ("float32", "float16", "bfloat16"), "triton": ("float32", "float16"),
          "pallas": ("float32", "float16", "bfloat16"), "pallas-tpu": ("float32", "float16", "bfloat16")}
NSA_EXAMPLES = {"xla": 8, "triton": 4, "pallas": 3, "pallas-tpu": 3}


def _window(draw) -> str:
    left = draw(st.integers(0, 40))
    right = draw(st.integers(1 if left == 0 else 0, 12))
    return f"window({left}, right={right})" if right else f"window({left})"


def _local(draw) -> str:
    before = draw(st.integers(0, 3))
    after = draw(st.integers(1 if before == 0 else 0, 2))
    return f"local({before}, after={after})" if after else f"local({before})"


def _stride(draw) -> str:
    every = draw(st.integers(1, 4))
    return f"stride(every={every}, offset={draw(st.integers(0, every - 1))})"


def _blocks(draw) -> str:
    ids = sorted(set(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3))))
    return f"blocks({', '.join(map(str, ids))})"


_ATOMS = (
    _window,
    _local,
    _stride,
    lambda draw: f"global(first={draw(st.integers(1, 3))})",
    _blocks,
    lambda draw: f"random({draw(st.integers(1, 3))}, seed={draw(st.integers(0, 999))})",
)


def _key_set(draw, depth: int) -> str:
    if depth == 0 or draw(st.booleans()):
        return draw(st.sampled_from(_ATOMS))(draw)
    operator = draw(st.sampled_from(["|", "&", "-"]))
    parts = [_key_set(draw, depth - 1) for _ in range(2 if operator == "-" else draw(st.integers(2, 3)))]
    return "(" + f" {operator} ".join(parts) + ")"


@st.composite
def patterns(draw) -> str:
    """A pattern's .nsa text: each branch ungated, gated, or gated with a default."""
    branches = draw(st.integers(1, 3))
    causality = draw(st.sampled_from(["causal", "bidirectional"]))
    lines = ["pattern fuzz", f"block {draw(st.sampled_from([16, 32, 64]))}", causality]
    lines += [f"gate g{index}" for index in range(branches)]
    for index in range(branches):
        gate_clause = draw(st.sampled_from(["", f" gate g{index}", f" gate g{index} default 0.5"]))
        lines.append(f"branch b{index} = {_key_set(draw, 2)}{gate_clause}")
    return "\n".join(lines) + "\n"


@st.composite
def shapes(draw) -> dict:
    """batch, seq_len, heads, head_dim and cu_seqlens (None, or packed sequences of one batch row,
    rows past the last one belonging to none)."""
    seq_len = draw(st.integers(1, 80))
    heads_kv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3, 5, 16]))
    cu_seqlens = None
    batch = draw(st.integers(1, 2))
    if draw(st.booleans()):
        batch = 1
        cuts = sorted(draw(st.lists(st.integers(0, seq_len), max_size=3)))
        end = draw(st.sampled_from([seq_len, cuts[-1] if cuts else seq_len]))
        cu_seqlens = np.array([0, *[c for c in cuts if c <= end], end], np.int32)
    return {"batch": batch, "seq_len": seq_len, "heads_kv": heads_kv, "heads_q": heads_kv * group,
            "head_dim": draw(st.sampled_from([8, 12, 20, 32, 100, 192])), "cu_seqlens": cu_seqlens,
            "seed": draw(st.integers(0, 2**32 - 1))}


def check(text: str, shape: dict, target: str, dtype: str = "float32") -> None:
    platform, config = TARGETS[target]
    attention = nsa_dsl.compile(text, config=config)
    rng = np.random.default_rng(shape["seed"])
    batch, seq_len, heads_q, heads_kv, head_dim = (
        shape[n] for n in ("batch", "seq_len", "heads_q", "heads_kv", "head_dim")
    )
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim, dtype=jnp.dtype(dtype))
    # Gates without a default are passed (a branch whose gate is not passed is dropped); those
    # with one, on every other example.
    gates = {
        b.gate.name: gate(rng, batch, seq_len, heads_q).astype(dtype)
        for b in attention.plan.branches
        if b.gate is not None and (b.gate.default is None or rng.random() < 0.5)
    }
    check_static(rng, attention, q, k, v, gates, shape["cu_seqlens"], platform=platform)


@pytest.mark.parametrize("target", sorted(EXAMPLES))
def test_random_static_patterns_match_the_reference(target):
    @settings(max_examples=EXAMPLES[target], deadline=None)
    @given(text=patterns(), shape=shapes(), dtype=st.sampled_from(DTYPES[target]))
    def one(text, shape, dtype):
        check(text, shape, target, dtype)

    one()


# Forced blocks: (the force= key set, the blocks it adds at most, whether selection block kb is
# forced for a query group whose last query lies in selection block qb).
_FORCES = (
    ("local(1)", 1, lambda qb, kb: kb == qb),
    ("local(2)", 2, lambda qb, kb: qb - 2 < kb <= qb),
    ("global(first=1)", 1, lambda qb, kb: kb < 1),
    ("blocks(1)", 1, lambda qb, kb: kb == 1),
)


@st.composite
def nsa_patterns(draw) -> tuple[str, NsaSpec, tuple[str, ...]]:
    """(source, its NsaSpec, the gates it declares) of a compress, a topk and maybe a window branch."""
    stride = draw(st.sampled_from([4, 8, 16]))
    cmp_block = stride * draw(st.sampled_from([1, 2]))
    sel_block = draw(st.sampled_from([16, 32, 64]))  # a power of two >= 16, a multiple of the stride
    forces = draw(st.lists(st.sampled_from(_FORCES), max_size=2, unique=True))
    count = sum(size for _, size, _ in forces) + draw(st.integers(1, 3))
    query_block = draw(st.sampled_from([1, 1, 2, 4, 16]))
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    force = f", force={' | '.join(text for text, _, _ in forces)}" if forces else ""
    per = f" per block({query_block})" if query_block > 1 else ""
    lines = [
        "pattern fuzz_nsa", "block 16", "causal",
        f"branch cmp = compress(block={cmp_block}, stride={stride}) gate g_cmp",
        f"branch slc = topk({count}, block={sel_block}, score=cmp{force}) gate g_slc{per}",
    ]
    if window is not None:
        lines.append(f"branch swa = window({window}) gate g_swa")
    spec = NsaSpec(
        compress_block=cmp_block, compress_stride=stride, select_count=count, select_block=sel_block,
        query_block=query_block, window=window,
        forced=lambda qb, kb: any(rule(qb, kb) for _, _, rule in forces),
    )
    return "\n".join(lines) + "\n", spec, ("cmp", "slc", "swa") if window is not None else ("cmp", "slc")


@pytest.mark.parametrize("target", sorted(NSA_EXAMPLES))
def test_random_native_sparse_attention_matches_the_paper(target):
    platform, config = TARGETS[target]

    @settings(max_examples=NSA_EXAMPLES[target], deadline=None)
    @given(pattern=nsa_patterns(), shape=shapes(), dtype=st.sampled_from([np.float32, np.float16]))
    def one(pattern, shape, dtype):
        source, spec, gates = pattern
        cu_seqlens = shape["cu_seqlens"]
        check_against_reference(
            np.random.default_rng(shape["seed"]), source, spec, batch=shape["batch"], seq_len=shape["seq_len"],
            heads_q=shape["heads_q"], heads_kv=shape["heads_kv"], head_dim=shape["head_dim"], dtype=dtype,
            cu_seqlens=None if cu_seqlens is None else list(cu_seqlens), gates=gates, platform=platform, config=config,
            ranked=False,
        )

    one()


@st.composite
def explicit_selections(draw) -> dict:
    """native_sparse_attention's explicit selection: the block size, entries a token (S), and
    block_counts as one int or per token (negative, and past S, included)."""
    return {"block": draw(st.sampled_from([16, 32, 64])), "width": draw(st.integers(1, 6)),
            "per_token_counts": draw(st.booleans())}


@pytest.mark.parametrize("target", sorted(NSA_EXAMPLES))
def test_random_explicit_selections_match_the_reference(target):
    """ejkernel's operation with block_indices: ids mostly in each token's range, some negative,
    past the token's block or past the sequence, and repeats (conftest.random_indices)."""
    platform, config = TARGETS[target]

    @settings(max_examples=NSA_EXAMPLES[target], deadline=None)
    @given(selection=explicit_selections(), shape=shapes(), dtype=st.sampled_from(DTYPES[target]))
    def one(selection, shape, dtype):
        rng = np.random.default_rng(shape["seed"])
        forward_tolerance, gradient_tolerance = TOLERANCE[dtype]
        batch, seq_len, heads_q, heads_kv, head_dim = (
            shape[n] for n in ("batch", "seq_len", "heads_q", "heads_kv", "head_dim")
        )
        cu_seqlens, block, width = shape["cu_seqlens"], selection["block"], selection["width"]
        q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim, dtype=jnp.dtype(dtype))
        g_slc = gate(rng, batch, seq_len, heads_q).astype(dtype)
        indices = random_indices(rng, batch, seq_len, heads_kv, width, block, cu_seqlens)
        counts = (rng.integers(-1, width + 2, (batch, seq_len, heads_kv)).astype(np.int32)
                  if selection["per_token_counts"] else int(rng.integers(0, width + 1)))
        cfg = dataclasses.replace(config or nsa_dsl.NativeSparseAttentionConfig(), block_size=block)
        scale = 1.0 / np.sqrt(head_dim)

        def run(q, k, v, g_slc, softmax_scale):
            return nsa_dsl.native_sparse_attention(q, k, v, None, g_slc, indices, counts, cu_seqlens,
                                                   softmax_scale=softmax_scale, platform=platform, cfg=cfg)

        mask = reference.selection_mask(indices, counts, block, cu_seqlens)
        out, pullback = jax.vjp(run, q, k, v, g_slc, jnp.float32(scale))
        assert out.dtype == q.dtype
        assert_close(out, reference.forward(q, k, v, [mask], [g_slc], scale), forward_tolerance, "output")
        d_out = rng.standard_normal(q.shape).astype(dtype)
        dq, dk, dv, dg, d_scale = pullback(jnp.asarray(d_out))
        wanted = reference.gradients(q, k, v, [mask], [g_slc], scale, d_out)
        floor = gradient_floor(wanted["q"], wanted["k"], wanted["v"])
        for name, actual, expected in (("q", dq, wanted["q"]), ("k", dk, wanted["k"]), ("v", dv, wanted["v"]),
                                       ("g_slc", dg, wanted["gates"][0])):
            assert_close(actual, expected, gradient_tolerance, f"d{name}", least=floor)
        assert_scale_gradient_close(d_scale, wanted["scale"], q, wanted["q"], scale, gradient_tolerance)

    one()


# Platforms whose kernels take a shard of the queries (context parallelism, prefill chunks,
# decoding steps); Pallas' TPU variant does not.
SHARD_EXAMPLES = {"xla": 10, "triton": 4, "pallas": 3}


@pytest.mark.parametrize("target", sorted(SHARD_EXAMPLES))
def test_a_shard_of_the_queries_is_those_rows_of_the_whole_call(target):
    """Queries [a, b) with query_offset=a against every key (a prefill chunk, a decoding step at
    b = a + 1, a context-parallel shard) give rows [a, b) of the whole call, and, for an output
    cotangent on those rows only, the same dq rows, dk, dv and gate gradients: for random static
    patterns and Native Sparse Attention (per token) on batches or packed sequences."""
    platform, config = TARGETS[target]

    @settings(max_examples=SHARD_EXAMPLES[target], deadline=None)
    @given(pattern=st.one_of(patterns(), nsa_patterns().filter(lambda p: p[1].query_block == 1).map(lambda p: p[0])),
           shape=shapes(), data=st.data())
    def one(pattern, shape, data):
        attention = nsa_dsl.compile(pattern, config=config)
        rng = np.random.default_rng(shape["seed"])
        batch, seq_len, heads_q, heads_kv, head_dim = (
            shape[n] for n in ("batch", "seq_len", "heads_q", "heads_kv", "head_dim")
        )
        first = data.draw(st.integers(0, seq_len - 1))
        end = data.draw(st.sampled_from([first + 1, data.draw(st.integers(first + 1, seq_len))]))
        q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
        gates = {g.name: gate(rng, batch, seq_len, heads_q) for g in attention.plan.gates}
        d_out = jnp.asarray(rng.standard_normal((batch, end - first, heads_q, head_dim)).astype(np.float32))

        def whole(q, k, v, gates):
            out = attention(q, k, v, cu_seqlens=shape["cu_seqlens"], platform=platform, **gates)
            return jnp.sum(out[:, first:end] * d_out), out[:, first:end]

        def shard(q, k, v, gates):
            out = attention(q, k, v, cu_seqlens=shape["cu_seqlens"], platform=platform, query_offset=first, **gates)
            return jnp.sum(out * d_out), out

        rows = {name: g[:, first:end] for name, g in gates.items()}
        (_, want), want_grads = jax.value_and_grad(whole, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, gates)
        (_, got), got_grads = jax.value_and_grad(shard, argnums=(0, 1, 2, 3), has_aux=True)(
            q[:, first:end], k, v, rows
        )
        forward_tolerance, gradient_tolerance = TOLERANCE["float32"]
        assert_close(got, want, forward_tolerance, "output")
        floor = gradient_floor(*want_grads[:3])
        assert_close(got_grads[0], want_grads[0][:, first:end], gradient_tolerance, "dq", least=floor)
        assert_close(got_grads[1], want_grads[1], gradient_tolerance, "dk", least=floor)
        assert_close(got_grads[2], want_grads[2], gradient_tolerance, "dv", least=floor)
        for name in gates:
            assert_close(got_grads[3][name], want_grads[3][name][:, first:end], gradient_tolerance, f"d{name}",
                         least=floor)

    one()


# ---- what the fuzz found, pinned -------------------------------------------------------------


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("seq_len, query_block", [(1, 16), (5, 2), (5, 16), (21, 16)])
def test_groups_of_queries_in_sequences_shorter_than_the_block(target, seq_len, query_block):
    """`per block(Q)` on a sequence shorter than the pattern's block: XLA's top-k tiles were the
    sequence's rows (fewer than a group's Q, or no multiple of it) and failed to reshape them.
    check_against_reference differentiates the softmax scale too, whose vjp crashed Pallas' top-k
    (on every length: the selection's launch took the traced scale undetached)."""
    platform, config = TARGETS[target]
    source = ("pattern p\nblock 16\ncausal\nbranch cmp = compress(block=4, stride=4) gate g_cmp\n"
              f"branch slc = topk(2, block=16, score=cmp) gate g_slc per block({query_block})\n")
    spec = NsaSpec(compress_block=4, compress_stride=4, select_count=2, select_block=16, query_block=query_block)
    check_against_reference(np.random.default_rng(seq_len), source, spec, batch=2, seq_len=seq_len, heads_q=2,
                            heads_kv=1, head_dim=8, gates=("cmp", "slc"), platform=platform, config=config,
                            ranked=False)  # one block: nothing to rank
