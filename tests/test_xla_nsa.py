"""Native Sparse Attention (compression, on-device top-k, selection, sliding window, gates) in
the XLA backend against the float64 reference written from the paper's equations
(tests/nsa_reference.py): selections (scores of the chosen blocks, so exact ties may differ),
outputs and gradients, for both NSA examples, odd lengths, GQA groups, packed sequences."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import nsa_dsl
from conftest import FORWARD_TOLERANCE, GRADIENT_TOLERANCE, assert_close, gate, normal, qkv
from nsa_check import check_against_reference
from nsa_reference import MEANPOOL, PAPER, NsaSpec, chosen_scores, nsa_gradients, nsa_reference, small_example

EXAMPLES = {"nsa": ("examples/nsa.nsa", PAPER), "nsa_meanpool": ("examples/nsa_meanpool.nsa", MEANPOOL)}


def small(spec: NsaSpec, **changes) -> tuple[dict, NsaSpec]:
    """Overrides that shrink an example to test sizes, and the matching reference spec."""
    from dataclasses import replace
    return changes, replace(spec, **changes)


def run_and_check(rng, source, spec, *, batch, seq_len, heads_q, heads_kv, head_dim, cu_seqlens=None, gates=("cmp", "slc", "swa")):
    attn = nsa_dsl.compile(source)
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    g = {name: gate(rng, batch, seq_len, heads_q) for name in gates if name != "swa" or spec.window is not None}
    kwargs = {f"g_{name}": value for name, value in g.items()}
    cu = None if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int32)

    # Selection: the kernel's blocks must score like the reference's best (ties may swap ids).
    (branch, kernel_chosen), = attn.selections(q, k, v, cu_seqlens=cu).items()
    _, _, ref_chosen, scores = nsa_reference(q, k, v, spec, gates=g, cu_seqlens=cu)
    kernel_chosen = np.asarray(kernel_chosen)
    assert ((kernel_chosen >= 0).sum(-1) == (ref_chosen >= 0).sum(-1)).all(), "number of selected blocks"
    for actual, wanted in ((kernel_chosen, ref_chosen),):
        got, want = chosen_scores(scores, actual), chosen_scores(scores, wanted)
        finite = np.isfinite(want)
        assert (np.isfinite(got) == finite).all()
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-6)

    # Outputs and gradients for the kernel's (validated) selection.
    out = attn(q, k, v, cu_seqlens=cu, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates=g, cu_seqlens=cu, selected=kernel_chosen)
    assert_close(out, expected, FORWARD_TOLERANCE, "output")

    d_out = normal(rng, *out.shape)
    names = sorted(kwargs)
    pullback = jax.jit(lambda q, k, v, gs, d: jax.vjp(
        lambda q, k, v, gs: attn(q, k, v, cu_seqlens=cu, **dict(zip(names, gs))), q, k, v, gs)[1](d))
    dq, dk, dv, dgates = pullback(q, k, v, [kwargs[n] for n in names], d_out)
    wanted = nsa_gradients(q, k, v, spec, g, kernel_chosen, d_out, cu_seqlens=cu)
    for name, actual in (("q", dq), ("k", dk), ("v", dv), *zip(names, dgates)):
        assert_close(actual, wanted[name], GRADIENT_TOLERANCE, f"d{name}")


@pytest.mark.parametrize("example", sorted(EXAMPLES))
@pytest.mark.parametrize(
    "seq_len, heads_q, heads_kv, head_dim",
    [(150, 4, 2, 32), (111, 16, 1, 60), (97, 4, 4, 16), (70, 8, 2, 100), (29, 24, 1, 16)],
)
def test_examples_match_the_paper(rng, example, seq_len, heads_q, heads_kv, head_dim):
    path, spec = EXAMPLES[example]
    # Small blocks so that short sequences have many of them: the paper's shape, scaled down.
    text = open(path).read()
    if example == "nsa":
        text = text.replace("block 64", "block 16").replace("compress(block=32, stride=16)", "compress(block=8, stride=4)")
        text = text.replace("topk(16, block=64", "topk(5, block=16").replace("window(512)", "window(24)")
        spec = NsaSpec(compress_block=8, compress_stride=4, select_count=5, select_block=16, window=24, forced=spec.forced)
    else:
        text = text.replace("block 64", "block 16").replace("compress(block=64, stride=64)", "compress(block=16, stride=16)")
        text = text.replace("topk(16, block=64", "topk(4, block=16")
        spec = NsaSpec(compress_block=16, compress_stride=16, select_count=4, select_block=16, forced=spec.forced)
    run_and_check(rng, text, spec, batch=1, seq_len=seq_len, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim)


def test_packed_sequences(rng):
    text = open("examples/nsa.nsa").read().replace("block 64", "block 16")
    text = text.replace("compress(block=32, stride=16)", "compress(block=8, stride=4)")
    text = text.replace("topk(16, block=64", "topk(5, block=16").replace("window(512)", "window(24)")
    spec = NsaSpec(compress_block=8, compress_stride=4, select_count=5, select_block=16, window=24, forced=PAPER.forced)
    run_and_check(rng, text, spec, batch=1, seq_len=160, heads_q=6, heads_kv=2, head_dim=24,
                  cu_seqlens=[0, 15, 70, 131, 150])  # rows past 150 belong to no sequence


def test_selection_per_block_of_queries(rng):
    text = (
        "pattern p\nblock 16\n"
        "branch cmp = compress(block=16, stride=8) gate g_cmp\n"
        "branch slc = topk(3, block=16, score=cmp, force=global(first=1)) per block(8) gate g_slc\n"
    )
    spec = NsaSpec(compress_block=16, compress_stride=8, select_count=3, select_block=16, query_block=8,
                   forced=lambda qb, kb: kb < 1)
    run_and_check(rng, text, spec, batch=2, seq_len=75, heads_q=4, heads_kv=2, head_dim=16, gates=("cmp", "slc"))


def test_a_stride_bounded_by_a_local_is_forced_whole(rng):
    """force= with a stride is taken once `&` bounds it and topk's count holds the bound (an unbounded
    one is refused: at run time its blocks were cut to the count by id, a query's own dropped)."""
    text = (
        "pattern p\nblock 16\n"
        "branch cmp = compress(block=16, stride=8) gate g_cmp\n"
        "branch slc = topk(6, block=16, score=cmp, force=stride(2, 1) & local(6)) gate g_slc\n"
    )
    spec = NsaSpec(compress_block=16, compress_stride=8, select_count=6, select_block=16,
                   forced=lambda qb, kb: kb % 2 == 1 and qb - 6 < kb <= qb)
    run_and_check(rng, text, spec, batch=1, seq_len=150, heads_q=4, heads_kv=2, head_dim=20, gates=("cmp", "slc"))


def test_native_sparse_attention_with_g_cmp_is_ejkernels_configuration(rng):
    batch, seq_len, heads_q, heads_kv, head_dim, block = 2, 90, 8, 2, 32, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    g_cmp, g_slc = gate(rng, batch, seq_len, heads_q), gate(rng, batch, seq_len, heads_q)
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=block)
    out = nsa_dsl.native_sparse_attention(q, k, v, g_cmp, g_slc, None, 3, None, cfg=cfg)
    plan = nsa_dsl.api.compressed_selection_plan(block, 3)
    chosen = np.asarray(nsa_dsl.runtime.selections(plan, q, k, v)["slc"])
    spec = NsaSpec(compress_block=block, compress_stride=block, select_count=3, select_block=block,
                   forced=lambda qb, kb: kb == qb)
    _, _, ref_chosen, scores = nsa_reference(q, k, v, spec, gates={"cmp": g_cmp, "slc": g_slc})
    np.testing.assert_allclose(chosen_scores(scores, chosen), chosen_scores(scores, ref_chosen), rtol=1e-4, atol=1e-6)
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates={"cmp": g_cmp, "slc": g_slc}, selected=chosen)
    assert_close(out, expected, FORWARD_TOLERANCE, "output")
    with pytest.raises(ValueError, match="block_counts"):
        nsa_dsl.native_sparse_attention(q, k, v, g_cmp, g_slc, None, np.full((batch, seq_len, heads_kv), 3), None, cfg=cfg)


def test_bf16_inputs_and_jit(rng):
    """bfloat16 in and out, computed in float32: against the float64 reference on the same
    bfloat16-rounded inputs (200 tokens: every row takes all of its 64-token blocks)."""
    import jax.numpy as jnp
    attn = nsa_dsl.compile("examples/nsa_meanpool.nsa")
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in qkv(rng, 1, 200, 4, 1, 64))
    g = {"cmp": gate(rng, 1, 200, 4), "slc": gate(rng, 1, 200, 4)}
    low = jax.jit(lambda q, k, v: attn(q, k, v, g_cmp=g["cmp"], g_slc=g["slc"]))(q, k, v)
    assert low.dtype == jnp.bfloat16
    rounded = [np.asarray(x, np.float32) for x in (q, k, v)]
    expected, _, _, _ = nsa_reference(*rounded, MEANPOOL, gates=g)
    assert_close(np.asarray(low, np.float32), expected, 1e-2, "bf16 output")


def test_learned_pooling_is_traced_into_the_kernel(rng):
    """Selections, output and every gradient, the pooling weights' against float64 central
    differences of the reference (nsa_check), through pool_fns closing over traced weights."""
    text = (
        "pattern p\nblock 16\n"
        "branch cmp = compress(block=8, stride=4, pool=learned) gate g_cmp\n"
        "branch slc = topk(3, block=16, score=cmp, force=local(1)) gate g_slc\n"
    )
    spec = NsaSpec(compress_block=8, compress_stride=4, select_count=3, select_block=16,
                   forced=lambda qb, kb: kb == qb, pool_weights=tuple(rng.uniform(0.0, 0.3, 8)))
    check_against_reference(rng, text, spec, batch=1, seq_len=70, heads_q=4, heads_kv=2, head_dim=16,
                            gates=("cmp", "slc"), platform="xla")
    q, k, v = qkv(rng, 1, 70, 4, 2, 16)
    with pytest.raises(ValueError, match="pool_fns"):
        nsa_dsl.compile(text)(q, k, v, g_cmp=gate(rng, 1, 70, 4))


def test_packed_sequences_of_exactly_one_compressed_block(rng):
    """Packed sequences of exactly compress(block=8) rows (one compressed key, complete at their
    last row), of one key more, shorter than a block, and a long one; rows past the last sequence."""
    source, spec = small_example("nsa")
    run_and_check(rng, source, spec, batch=1, seq_len=93, heads_q=4, heads_kv=2, head_dim=16,
                  cu_seqlens=[0, 8, 20, 27, 83, 91])


def test_a_selection_block_past_a_short_sequence_the_stride_does_not_divide(rng):
    """topk(2, block=64) on sequences of 41 rows, scored from compressed keys of stride 4: the
    block fitted to the keys (a multiple of the stride, 44) is every row's only block, holding
    all of its keys, and its one selected block (a block of 40 would give rows from 40 on a
    second one)."""
    source = ("pattern p\nblock 16\nbranch cmp = compress(block=8, stride=4) gate g_cmp\n"
              "branch slc = topk(2, block=64, score=cmp) gate g_slc\n")
    spec = NsaSpec(compress_block=8, compress_stride=4, select_count=2, select_block=64)
    run_and_check(rng, source, spec, batch=2, seq_len=41, heads_q=4, heads_kv=2, head_dim=16, gates=("cmp", "slc"))


def test_groups_of_queries_wider_than_the_selection_block(rng):
    """per block(32) with selection blocks of 16: a group's last query decides which blocks are
    valid for all 32 of its queries (its first query's blocks are fewer), scored as one."""
    source = ("pattern p\nblock 64\nbranch cmp = compress(block=8, stride=4) gate g_cmp\n"
              "branch slc = topk(2, block=16, score=cmp) per block(32) gate g_slc\n")
    spec = NsaSpec(compress_block=8, compress_stride=4, select_count=2, select_block=16, query_block=32)
    run_and_check(rng, source, spec, batch=1, seq_len=77, heads_q=4, heads_kv=2, head_dim=16, gates=("cmp", "slc"))
