"""Native Sparse Attention on the Pallas backend (compression attention, top-k scoring and
selection in the kernel, the selection and sliding-window kernels, gates), run with
interpret=True on the CPU (the same kernel functions pl.pallas_call lowers through Triton on a
GPU), against the float64 reference written from the paper's equations (tests/nsa_reference.py):
the selected blocks (their reference scores, so that exact ties may pick other ids), outputs and
the gradients of q, k, v and every gate (nsa_check's cases: the softmax scale's too, and a top-k
that must leave blocks out); both NSA examples, odd lengths, GQA groups 1, 3, 16 and 24, head
dims 16, 20 and 24, packed sequences, selection per block of queries, learned pooling, float16;
several steps of every kernel loop (small steps patched in), the GPU's and the TPU's padded tile
layouts in the interpreter, and the kernels lowered (not run) for CUDA and a TPU. Shapes are
small: the interpreter runs every program in Python."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    FORWARD_TOLERANCE,
    GRADIENT_TOLERANCE,
    assert_close,
    gate,
    lower_for_cuda,
    normal,
    qkv,
)
from nsa_check import check_against_reference, check_compression_against_reference
from nsa_reference import PAPER, NsaSpec, chosen_scores, nsa_gradients, nsa_reference

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.runtime import dispatch


def paper_example():
    """examples/nsa.nsa scaled down: l = 8, d = 4, n = 5 blocks of l' = 16, window 24."""
    text = Path("examples/nsa.nsa").read_text().replace("block 64", "block 16")
    text = text.replace("compress(block=32, stride=16)", "compress(block=8, stride=4)")
    text = text.replace("topk(16, block=64", "topk(5, block=16").replace("window(512)", "window(24)")
    spec = NsaSpec(compress_block=8, compress_stride=4, select_count=5, select_block=16, window=24, forced=PAPER.forced)
    return text, spec


def meanpool_example():
    """examples/nsa_meanpool.nsa scaled down: l = d = l' = 16, n = 4."""
    text = Path("examples/nsa_meanpool.nsa").read_text().replace("block 64", "block 16")
    text = text.replace("compress(block=64, stride=64)", "compress(block=16, stride=16)").replace(
        "topk(16, block=64", "topk(4, block=16"
    )
    spec = NsaSpec(
        compress_block=16, compress_stride=16, select_count=4, select_block=16, forced=lambda qb, kb: kb == qb
    )
    return text, spec


def run_and_check(
    rng,
    text,
    spec,
    *,
    batch,
    seq_len,
    heads_q,
    heads_kv,
    head_dim,
    cu_seqlens=None,
    dtype=np.float32,
    pool_fns=None,
    patch=None,
    gradients=True,
    config=None,
):
    """Selection, output and (with `gradients`) gradients of the pattern `text` through the Pallas
    module (config=TPU: its TPU variant), in one jit, against the reference; patch(module) may
    change its tile constants first."""
    attention = nsa_dsl.compile(text)
    module = codegen.load_module("pallas", attention.plan, config)
    if patch is not None:
        patch(module)
    q, k, v = (x.astype(dtype) for x in qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim))
    gate_names = sorted(g.name for g in attention.plan.gates)
    gates = {name: gate(rng, batch, seq_len, heads_q).astype(dtype) for name in gate_names}
    d_out = normal(rng, batch, seq_len, heads_q, head_dim).astype(dtype)
    cu = None if cu_seqlens is None else np.asarray(cu_seqlens, np.int32)
    tables = dispatch.branch_tables(attention.plan, seq_len)
    scale = 1.0 / np.sqrt(head_dim)
    options = {"tables": tables, "cu_seqlens": cu, "softmax_scale": scale, "pool_fns": pool_fns}

    def everything(q, k, v, gates, d_out):
        (chosen,) = module.selections(q, k, v, **options).values()
        out, pullback = jax.vjp(
            lambda q, k, v, gates: module.attention(q, k, v, gates=gates, **options), q, k, v, gates
        )
        return chosen, out, pullback(d_out) if gradients else None

    chosen, out, cotangents = jax.jit(everything)(q, k, v, gates, d_out)
    assert out.shape == q.shape and out.dtype == q.dtype

    as64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    q, k, v, d_out = (as64(x) for x in (q, k, v, d_out))
    weights = {name.removeprefix("g_"): as64(g) for name, g in gates.items()}
    # Selection: the kernel's blocks must score like the reference's best (ties may swap ids).
    _, _, ref_chosen, scores = nsa_reference(q, k, v, spec, gates=weights, cu_seqlens=cu)
    chosen = np.asarray(chosen)
    assert ((chosen >= 0).sum(-1) == (ref_chosen >= 0).sum(-1)).all(), "number of selected blocks"
    got, want = chosen_scores(scores, chosen), chosen_scores(scores, ref_chosen)
    finite = np.isfinite(want)
    assert (np.isfinite(got) == finite).all()
    score_tolerance = 1e-4 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(got[finite], want[finite], rtol=score_tolerance, atol=score_tolerance * 1e-2)

    # Outputs and gradients for the kernel's (validated) selection.
    forward_tolerance, gradient_tolerance = (
        (FORWARD_TOLERANCE, GRADIENT_TOLERANCE) if dtype == np.float32 else (5e-3, 5e-3)
    )
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates=weights, cu_seqlens=cu, selected=chosen)
    assert_close(as64(out), expected, forward_tolerance, "output")
    if not gradients:
        return
    dq, dk, dv, d_gates = cotangents
    wanted = nsa_gradients(q, k, v, spec, weights, chosen, d_out, cu_seqlens=cu)
    for name, actual in (("q", dq), ("k", dk), ("v", dv), *d_gates.items()):
        assert_close(as64(actual), wanted[name], gradient_tolerance, f"d{name}")


def test_paper_example_in_several_steps(rng, monkeypatch):
    """16 compressed keys per step of the compression kernels, 3 selection blocks per step of the
    top-k kernel: loops of several steps, chunks merged into the running top-k."""
    text, spec = paper_example()

    def small_steps(module):
        monkeypatch.setattr(module, "COMPRESSED_KEYS", 16)
        monkeypatch.setattr(module, "SCORED_KEYS", 16)

    run_and_check(rng, text, spec, batch=1, seq_len=97, heads_q=6, heads_kv=2, head_dim=24, patch=small_steps)


def test_top_k_in_many_chunks_without_forced_blocks_at_the_end(rng, monkeypatch):
    """The GPU variant's top-k over chunks of 3 selection blocks (16 compressed keys a step, l = 8,
    d = 4), 10 blocks, top-4 with only block 0 forced, one selection group a program (per block(16)):
    a chunk must be merged where one of its blocks beats the group's last kept block (the kernel
    skips the chunks that beat none), and a block it keeps may stay to the end, as no forced
    block comes after it. Selections and output."""
    text = (
        "pattern p\nblock 16\n"
        "branch cmp = compress(block=8, stride=4) gate g_cmp\n"
        "branch slc = topk(4, block=16, score=cmp, force=global(first=1)) per block(16) gate g_slc\n"
    )
    spec = NsaSpec(compress_block=8, compress_stride=4, select_count=4, select_block=16, query_block=16,
                   forced=lambda qb, kb: kb < 1)

    def small_steps(module):
        monkeypatch.setattr(module, "SCORED_KEYS", 16)

    run_and_check(rng, text, spec, batch=1, seq_len=150, heads_q=4, heads_kv=2, head_dim=16, patch=small_steps,
                  gradients=False)


@pytest.fixture
def pallas_constants(monkeypatch):
    """set(**constants): every Pallas module the test's calls load (nsa_dsl runs the plan fitted to
    the keys, Plan.fitted) gets these tile constants; no trace made with them outlives the test."""
    patched = []

    def set_constants(**constants):
        load = codegen.load_module

        def loading(platform, plan, config=None):
            module = load(platform, plan, config)
            if platform == "pallas":
                for name, value in constants.items():
                    monkeypatch.setattr(module, name, value)
                patched.append(module)
            return module

        monkeypatch.setattr(codegen, "load_module", loading)
        dispatch.generated_module.cache_clear()
        dispatch.kernel.cache_clear()
        jax.clear_caches()

    yield set_constants
    dispatch.generated_module.cache_clear()
    dispatch.kernel.cache_clear()
    jax.clear_caches()
    assert patched, "the test loaded no Pallas module to patch"


def test_meanpool_example_on_packed_sequences_in_gpu_tile_layouts(rng, pallas_constants):
    """Sixteen query heads per KV head, in the power-of-two tiles of the GPU lowering (a query
    tile spans two programs; the top-k kernel scores 16 queries, padded, at a time); packed
    sequences of 15, 86 (6 blocks: the top-4 leaves some out) and 51 tokens, rows past 152 in none."""
    text, spec = meanpool_example()
    pallas_constants(POWER_OF_TWO_TILES=True)
    check_against_reference(rng, text, spec, batch=1, seq_len=163, heads_q=16, heads_kv=1, head_dim=20,
                            cu_seqlens=[0, 15, 101, 152], gates=("cmp", "slc"), platform="pallas")


def check_per_block_learned(rng, **options):
    """run_and_check (with `options`) of top-3 of 16-token blocks per block(8) of queries, scored
    by a compression with learned pooling (a weighted sum of each block's 16 tokens, fresh
    weights), two batch rows of 75 tokens, float16."""
    text = (
        "pattern p\nblock 16\n"
        "branch cmp = compress(block=16, stride=8, pool=learned) gate g_cmp\n"
        "branch slc = topk(3, block=16, score=cmp, force=global(first=1)) per block(8) gate g_slc\n"
    )
    weights = rng.uniform(0.0, 0.3, 16)
    spec = NsaSpec(compress_block=16, compress_stride=8, select_count=3, select_block=16, query_block=8,
                   forced=lambda qb, kb: kb < 1, pool_weights=tuple(weights))

    def weighted(k_blocks, v_blocks):
        w = jnp.asarray(weights, jnp.float32)
        return jnp.einsum("cjhd,j->chd", k_blocks, w), jnp.einsum("cjhd,j->chd", v_blocks, w)

    run_and_check(rng, text, spec, batch=2, seq_len=75, heads_q=2, heads_kv=2, head_dim=16, dtype=np.float16,
                  pool_fns={"cmp": weighted}, **options)


def test_selection_per_block_of_queries_with_learned_pooling_float16(rng):
    """Forward only: per block(Q) and the pooling function change what the top-k kernel scores
    and the compression kernels read, not their gradients' kernels (tested above)."""
    check_per_block_learned(rng, gradients=False)


@pytest.mark.filterwarnings("error:Explicitly requested dtype float64")
def test_learned_pooling_of_float64_weights_under_x64(rng):
    """Under jax_enable_x64 the kernels trace with x64 off, but the caller's pooling function runs
    as the caller set x64: its float64 weights pool in float64 (JAX warned it truncated them to
    float32), and output and gradients, the weights' included, are float64 and XLA's."""
    attention = nsa_dsl.compile(
        "pattern p\nblock 16\n"
        "branch cmp = compress(block=16, stride=8, pool=learned) gate g_cmp\n"
        "branch slc = topk(3, block=16, score=cmp) gate g_slc\n"
    )
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x) for x in qkv(rng, 1, 75, 4, 2, 16, dtype=np.float64))
        gates = {name: jnp.asarray(gate(rng, 1, 75, 4), jnp.float64) for name in ("g_cmp", "g_slc")}
        weights = jnp.asarray(rng.uniform(0.0, 0.3, 16))

        def loss(weights, q, k, platform):
            def pool(k_blocks, v_blocks):
                return jnp.einsum("cjhd,j->chd", k_blocks, weights), jnp.einsum("cjhd,j->chd", v_blocks, weights)

            out = attention(q, k, v, platform=platform, pool_fns={"cmp": pool}, **gates)
            return (out**2).sum(), out

        gradients = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnames="platform")
        (d_weights, d_q, d_k), out = gradients(weights, q, k, platform="pallas")
        (want_weights, want_q, want_k), want_out = gradients(weights, q, k, platform="xla")
    assert out.dtype == d_weights.dtype == d_q.dtype == d_k.dtype == jnp.float64
    assert_close(out, want_out, FORWARD_TOLERANCE, "output")
    for name, got, want in (("d weights", d_weights, want_weights), ("dq", d_q, want_q), ("dk", d_k, want_k)):
        assert_close(got, want, GRADIENT_TOLERANCE, name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float64])
def test_kernels_lower_to_triton_for_a_gpu(rng, monkeypatch, dtype):
    """Without a GPU here, lower (not run) forward and backward for CUDA, in bfloat16, and in float64
    under jax_enable_x64 (computed in float32; x64's int64 values met the kernels' int32 indices
    there, and tracing failed): every kernel (compression, top-k per block of queries, selection,
    sliding window; their dq and dk/dv) must go through Pallas' Triton lowering."""
    text, _ = paper_example()
    text = text.replace("local(2))", "local(2)) per block(4)")
    attention = nsa_dsl.compile(text)
    module = codegen.load_module("pallas", attention.plan)
    monkeypatch.setattr(module, "ON_GPU", True)
    monkeypatch.setattr(module, "POWER_OF_TWO_TILES", True)
    q, k, v = (np.asarray(x, dtype) for x in qkv(rng, 1, 97, 6, 2, 24))
    gates = {f"g_{name}": np.asarray(gate(rng, 1, 97, 6), dtype) for name in ("cmp", "slc", "swa")}
    tables = dispatch.branch_tables(attention.plan, 97)

    def loss(q, k, v):
        out = module.attention(q, k, v, gates=gates, tables=tables, cu_seqlens=None, softmax_scale=0.2)
        return jnp.sum(out.astype(jnp.float32))

    for function, kernels in ((loss, 4), (jax.grad(loss, argnums=(0, 1, 2)), 10)):
        with jax.enable_x64(dtype == jnp.float64):
            text = lower_for_cuda(jax.jit(function), q, k, v).as_text()
        assert text.count("__gpu$xla.gpu.triton") == kernels


# ---- the TPU (Mosaic) variant: pallas/tpu_nsa.py.j2 --------------------------------------------

TPU = nsa_dsl.NativeSparseAttentionConfig(backend="tpu")


@pytest.mark.parametrize("config", [None, TPU], ids=["gpu variant", "tpu variant"])
@pytest.mark.parametrize(
    "block, stride, batch, seq_len, heads_q, heads_kv, head_dim, cu_seqlens",
    [
        # 100 keys: 4 steps of 32 (GPU, float32; the last of 4), 2 tiles of 64 (TPU); a last token past every key
        (4, 2, 1, 203, 6, 2, 20, None),
        (8, 2, 2, 149, 4, 1, 36, None),  # two batch rows of 71 keys, l = 4d: 3 steps (GPU), 2 tiles (TPU)
        (4, 4, 1, 211, 3, 1, 24, [0, 45, 190]),  # packed, 45 and 145 tokens, rows past 190 in none; group 3, l = d
    ],
)
def test_compression_attention_over_several_key_steps_and_query_tiles(rng, config, block, stride, batch, seq_len,
                                                                     heads_q, heads_kv, head_dim, cu_seqlens):
    """The compression branch alone (compressed_forward, its dq and dk/dv) of both variants, output
    and gradients against the float64 dense reference on inputs whose scores rise along the
    sequence (each step of a query tile's walk over the compressed keys finds a new maximum: the
    online softmax must rescale what it summed), lengths no multiple of the stride (a last,
    partial step of keys, rows masked in it), and sequences of up to 13 query tiles of 16 rows,
    whose gradients each compressed tile's dk/dv program sums tile after tile."""
    check_compression_against_reference(rng, block=block, stride=stride, batch=batch, seq_len=seq_len,
                                        heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, cu_seqlens=cu_seqlens,
                                        platform="pallas", config=config)


@pytest.mark.parametrize("config", [None, TPU], ids=["gpu variant", "tpu variant"])
def test_a_group_of_24_heads(rng, config):
    """GQA 24 (more than 16, not a power of two): tiles of 32 head slots, 8 of them padding; 85
    tokens, 6 blocks: past the 3 forced, the top-5 ranks 3 for 2 places."""
    text, spec = paper_example()
    check_against_reference(rng, text, spec, batch=1, seq_len=85, heads_q=24, heads_kv=1, head_dim=16,
                            platform="pallas", config=config)


def test_tpu_variant_paper_example_in_several_chunks(rng, monkeypatch):
    """Compressed tiles of 4 keys and chunks of 3 selection blocks: every loop takes several steps,
    and the last compressed key of each chunk (l/d = 2) carries its mass into the next chunk's
    first block. 13 blocks, 5 selected, 3 of them forced: the scores decide the other two."""
    text, spec = paper_example()

    def small_steps(module):
        monkeypatch.setattr(module, "CMP_KEYS", 4)
        monkeypatch.setattr(module, "SCORED_BLOCKS", 3)

    run_and_check(
        rng, text, spec, batch=1, seq_len=200, heads_q=6, heads_kv=2, head_dim=24, patch=small_steps, config=TPU
    )


def test_tpu_variant_meanpool_on_packed_sequences_in_tpu_tiles(rng, pallas_constants):
    """Sixteen query heads of one KV head on the TPU's (8, 128)-padded layouts (head dim 20 ->
    128, groups -> 128 lanes), chunks of 2 blocks; packed sequences of 15, 84 (6 blocks: the top-4
    leaves some out) and 18 tokens, rows past the last in none."""
    text, spec = meanpool_example()
    pallas_constants(TPU_TILES=True, SCORED_BLOCKS=2)
    check_against_reference(rng, text, spec, batch=1, seq_len=131, heads_q=16, heads_kv=1, head_dim=20,
                            cu_seqlens=[0, 15, 99, 117], gates=("cmp", "slc"), platform="pallas", config=TPU)


def test_tpu_variant_per_block_of_queries_with_learned_pooling_float16(rng, monkeypatch):
    check_per_block_learned(rng, patch=lambda m: monkeypatch.setattr(m, "SCORED_BLOCKS", 2), config=TPU)


def test_tpu_variant_schedules_of_a_long_sequence_fit_scalar_memory():
    """examples/nsa.nsa at 256k tokens (HQ 64, HKV 4, D 128, bfloat16), forward and gradients traced
    (nothing runs) with the TPU variant: every launch's schedule fits in a core's scalar memory
    (the selection kernels in several launches; the compression and top-k schedules are two
    numbers a program, not a list of visits that grows with the square of the sequence: 4 MiB)."""
    attention = nsa_dsl.compile("examples/nsa.nsa")
    module = codegen.load_module("pallas", attention.plan, TPU)
    seq_len = 262144
    q = jax.ShapeDtypeStruct((1, seq_len, 64, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq_len, 4, 128), jnp.bfloat16)
    gates = {g.name: jnp.ones((1, seq_len, 64), jnp.bfloat16) for g in attention.plan.gates}
    options = {"tables": dispatch.branch_tables(attention.plan, seq_len), "cu_seqlens": None, "softmax_scale": 0.1}

    def loss(q, k, v):
        return jnp.sum(module.attention(q, k, v, gates=gates, **options).astype(jnp.float32))

    jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float64])
def test_tpu_variant_kernels_lower_for_a_tpu(monkeypatch, dtype):
    """Lower (not run) forward and backward for a TPU from the CPU: compression (forward, dq, dk/dv),
    top-k, selection and the window's kernels go through Pallas' Mosaic lowering on (8, 128) tiles;
    float64 under jax_enable_x64 as float32 (Mosaic refused the 64-bit types x64 made)."""
    text, _ = paper_example()
    attention = nsa_dsl.compile(text)
    module = codegen.load_module("pallas", attention.plan, TPU)
    monkeypatch.setattr(module, "TPU_TILES", True)
    monkeypatch.setattr(module, "INTERPRET", False)
    q, k = jax.ShapeDtypeStruct((1, 200, 6, 24), dtype), jax.ShapeDtypeStruct((1, 200, 2, 24), dtype)
    gates = {g.name: jax.ShapeDtypeStruct((1, 200, 6), dtype) for g in attention.plan.gates}
    options = {"tables": dispatch.branch_tables(attention.plan, 200), "cu_seqlens": None, "softmax_scale": 0.2}

    def loss(q, k, v, gates):
        return jnp.sum(module.attention(q, k, v, gates=gates, **options).astype(jnp.float32))

    forward = {"compressed_forward", "topk_selection", "selection_forward", "static_forward"}
    backward = {
        "compressed_backward_dq",
        "compressed_backward_dkdv",
        "selection_backward_dq",
        "selection_backward_dkdv",
        "static_backward_dq",
        "static_backward_dkdv",
    }
    for function, kernels in ((loss, forward), (jax.grad(loss, argnums=(0, 1, 2)), forward | backward)):
        with jax.enable_x64(dtype == jnp.float64):
            text = jax.jit(function).trace(q, k, k, gates).lower(lowering_platforms=("tpu",)).as_text()
        assert set(re.findall(r'kernel_name = "(\w+)"', text)) == kernels


# ---- the top-k's running best (keep_best of both variants) ---------------------------------------


def best_in_numpy(scores, count):
    """Per row of scores [rows, blocks] (-inf: not a candidate): the ids of its `count` best,
    best first, the lower id first on exact ties (lax.top_k's order, nsa_reference's), -1 unused."""
    best = np.full((scores.shape[0], count), -1)
    for row, row_scores in enumerate(np.asarray(scores, np.float64)):
        ids = np.flatnonzero(row_scores > -np.inf)
        ranked = ids[np.lexsort((ids, -row_scores[ids]))][:count]
        best[row, : ranked.size] = ranked
    return best


def tied_scores(rng, rows, blocks):
    """Candidate scores [rows, blocks] in float32 with exact ties within and across chunks: values
    drawn from a few, some +inf (forced), some -inf (not valid); the second half of the rows has
    candidates among its first 4 blocks only (fewer than the count, often: empty slots)."""
    values = np.array([0.0, 0.375, 1.25, np.inf, -np.inf], np.float32)
    scores = rng.choice(values, (rows, blocks), p=[0.3, 0.3, 0.25, 0.05, 0.1])
    scores[rows // 2 :, 4:] = -np.inf
    return scores


@pytest.mark.parametrize("count", [3, 5])
def test_keep_best_breaks_ties_towards_the_lower_block_id(rng, count):
    """The top-k's running best of both variants (topk_kernel's keep_best, chunk after chunk of
    blocks, as the kernels walk them) on scores with exact ties within a chunk and across chunks,
    forced (+inf) and invalid (-inf) candidates: the best `count` ids, best first, the lower id
    first on ties. The NSA tests compare the scores of the chosen blocks, which an exact tie leaves
    equal whichever block wins it."""
    text, _ = paper_example()
    plan = nsa_dsl.compile(text).plan
    rows, chunk, chunks = 32, 8, 5
    scores = tied_scores(rng, rows, chunk * chunks)
    want = best_in_numpy(scores, count)

    gpu = codegen.load_module("pallas", plan, None)
    top_pad = 1 << (count - 1).bit_length()
    best = (jnp.full((rows, top_pad), -jnp.inf), jnp.full((rows, top_pad), -1, jnp.int32))
    for c in range(chunks):
        block_ids = jnp.broadcast_to(c * chunk + jnp.arange(chunk, dtype=jnp.int32), (rows, chunk))
        best = gpu.keep_best(best, jnp.asarray(scores[:, c * chunk : (c + 1) * chunk]), block_ids, count)
    np.testing.assert_array_equal(np.asarray(best[1])[:, :count], want, "gpu variant")

    tpu = codegen.load_module("pallas", plan, TPU)  # [slots, groups]: a group a lane
    kept = (jnp.full((top_pad, rows), -jnp.inf), jnp.full((top_pad, rows), -1, jnp.int32))
    for c in range(chunks):
        block_ids = jnp.broadcast_to(c * chunk + jnp.arange(chunk, dtype=jnp.int32)[:, None], (chunk, rows))
        kept = tpu.keep_best(*kept, jnp.asarray(scores[:, c * chunk : (c + 1) * chunk].T), block_ids, count)
    np.testing.assert_array_equal(np.asarray(kept[1]).T[:, :count], want, "tpu variant")
