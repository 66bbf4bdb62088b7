"""Context parallelism on the Pallas platform's GPU variant: a shard of the queries (rows [offset,
offset + Tq) of the keys' sequence axis) against every key, through `nsa_dsl.runtime.attend(...,
query_offset=)` and `selections(..., query_offset=)` in one process (no mesh), the kernels run
with interpret=True on the CPU, against the float64 references (tests/reference.py,
tests/nsa_reference.py) on fresh random inputs. The checks are tests/test_triton_context_parallel.py's
(every shard's output rows; one middle shard's gradients for a cotangent on its rows only; the
shards' gradients put together for a full one), run on platform="pallas", with shards on and
off block edges, single queries among them.

- static branches (the Pallas kernels walk block tables: window | global prefix | stride
  progression, and a local range) on packed sequences straddling shards, rows past the last
  sequence, offsets traced under jit, on the GPU's padded tile layouts: a query tile split
  between two programs, which a shard clips mid-tile;
- static branches bidirectional (random draws, set algebra), so that a shard's queries see keys
  of later shards; packed, float16, GQA group 3, head dim 20, uneven shards, Python int offsets;
- explicit selection (block_indices / block_counts), two batch rows, GQA group 4, head dim 24,
  a traced softmax scale;
- full NSA (compression, top-k with forced blocks, sliding window) on packed sequences, one too
  short to compress, on the GPU's tile layouts with several compressed-key steps a loop: each
  shard's selections score like the reference's best;
- top-k `per block(8)` on packed sequences, groups straddling shards, scored from every query
  (scoring_query);
- shards of several batch rows (a shift per batch row): full NSA, each kernel one pallas_call for
  all rows, and table branches;
- the kernels with a traced shard offset lower (not run) for CUDA; the TPU variant refuses a
  shard.

Until nsa_dsl.runtime.dispatch lists "pallas" among the platforms that take a shard of the
queries, a fixture adds it for these tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gate, lower_for_cuda, qkv
from nsa_reference import NsaSpec
from test_triton_context_parallel import (
    FLOAT16_TOLERANCE,
    check_batch_row_shards,
    check_batch_row_tables,
    check_every_shard,
    check_explicit_selection,
    check_nsa_shards,
    check_per_block_groups,
    shards,
    static_attention,
    static_reference,
)

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.config import NativeSparseAttentionConfig
from nsa_dsl.runtime import attend, dispatch

PLATFORM = "pallas"
BLOCK = 16


def generated(plan, config=None):
    """The generated module attend runs for (plan, config): tests patch its tile constants."""
    return codegen.load_module(PLATFORM, plan, dispatch.for_device(config))


# ---- static branches ---------------------------------------------------------------------------


def test_static_branches_on_packed_sequences_in_gpu_tile_layouts(rng, monkeypatch):
    """Two gated static branches; sequences start and end inside the four shards of 32 rows, one
    is empty, rows 119.. are in none. GQA group 8 in float32 on the GPU's layouts: a query tile of
    16 queries is two programs of 8, so a shard boundary inside a tile (sequence 1 spans rows
    21..49, shard 1 starts at 32) leaves a program with part of its queries and one with none;
    dk/dv walk only the query blocks of a key block's table row that hold a shard row. One jitted
    program for every shard."""
    plan = nsa_dsl.compile(
        f"pattern ranged\nblock {BLOCK}\ncausal\ngate g_loc\n"
        "branch swa = window(20) | global(first=1) | stride(every=3, offset=1) gate g_swa\n"
        "branch loc = local(2) gate g_loc\n"
    ).plan
    module = generated(plan)
    monkeypatch.setattr(module, "POWER_OF_TWO_TILES", True)
    assert module.tile_extents(8, 16, 4) == module.QueryTiles(8, 16, 16, 16, 8, 2)
    seq_len, heads_q, heads_kv, head_dim = 128, 8, 1, 16
    cu = np.array([0, 21, 50, 50, 87, 119], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, 1, seq_len, heads_q) for name in ("g_swa", "g_loc")}
    expected, gradients = static_reference(plan, q, k, v, gates, cu)
    output = check_every_shard(rng, static_attention(plan, cu, platform=PLATFORM), q, k, v, gates,
                               shards(0, 32, 45, 46, 96, 128), expected, gradients)
    assert not output[:, 119:].any(), "rows in no sequence attend to nothing: zeros"


def test_static_branches_bidirectional_float16_uneven_shards(rng):
    """Random draws, a union minus explicit blocks and an intersection, bidirectional so that a
    shard's queries see keys of later shards; packed sequences; GQA group 3, head dim 20; shards
    of 16, 32 and 16 rows at Python int offsets, eager."""
    plan = nsa_dsl.compile(
        f"pattern tabled\nblock {BLOCK}\nbidirectional\ngate g_near\ngate g_far\n"
        "branch near = (local(2, 1) | global(first=1) | random(2, seed=5)) - blocks(3) gate g_near\n"
        "branch far = stride(2) & window(40, 24) gate g_far\n"
    ).plan
    seq_len, heads_q, heads_kv, head_dim = 64, 3, 1, 20
    cu = np.array([0, 9, 37, 60], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim, dtype=np.float16)
    gates = {name: gate(rng, 1, seq_len, heads_q).astype(np.float16) for name in ("g_near", "g_far")}
    expected, gradients = static_reference(plan, q, k, v, gates, cu)
    check_every_shard(rng, static_attention(plan, cu, platform=PLATFORM), q, k, v, gates, shards(0, 16, 48, 64),
                      expected, gradients, traced=False, tolerances=(FLOAT16_TOLERANCE, FLOAT16_TOLERANCE))


# ---- explicit selection ------------------------------------------------------------------------


def test_explicit_selection_two_batch_rows_traced_scale(rng):
    """block_indices (some negative, past the token, repeated) and block_counts per token, cut to
    each shard's rows like the queries; two batch rows (one shard of each); the softmax scale a
    traced argument, its gradient too."""
    check_explicit_selection(rng, shards(0, 16, 29, 30, 64), platform=PLATFORM)


# ---- compression and top-k ---------------------------------------------------------------------


NSA = (
    f"pattern nsa\nblock {BLOCK}\ncausal\n"
    "branch cmp = compress(block=8, stride=4) gate g_cmp\n"
    "branch slc = topk(3, block=16, score=cmp, force=global(first=1) | local(1)) gate g_slc\n"
    "branch swa = window(24) gate g_swa\n"
)
NSA_SPEC = NsaSpec(compress_block=8, compress_stride=4, select_count=3, select_block=16, window=24,
                   forced=lambda qb, kb: kb < 1 or kb == qb)


def test_nsa_on_packed_sequences_in_gpu_tile_layouts(rng, monkeypatch):
    """Compression 8/4 (overlapping, Eq. 9 weights), top-3 of 16-token blocks with the first and
    the local block forced, window 24; a 6-token sequence too short to compress; rows 119.. in
    no sequence. Two KV heads, one query head each, in float32 on the GPU's layouts: top-k tiles
    of 64 queries from each sequence's start (rows 6..69, 70..99), which the shards clip, at rows
    64 and 96 where the top-k chooses (4 and 6 blocks valid, 2 forced); 16 compressed keys a step:
    several steps of every loop."""
    plan = nsa_dsl.compile(NSA).plan
    module = generated(plan)
    for name, value in (("POWER_OF_TWO_TILES", True), ("COMPRESSED_KEYS", 16), ("SCORED_KEYS", 16)):
        monkeypatch.setattr(module, name, value)
    seq_len, heads_q, heads_kv, head_dim = 128, 2, 2, 12
    cu = np.array([0, 6, 100, 119], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, 1, seq_len, heads_q) for name in ("g_cmp", "g_slc", "g_swa")}
    output = check_nsa_shards(rng, NSA, NSA_SPEC, q, k, v, gates, cu, shards(0, 32, 61, 62, 128), platform=PLATFORM)
    assert not output[:, 119:].any(), "rows in no sequence attend to nothing: zeros"


def test_topk_per_block_of_queries_straddling_shards(rng):
    """Groups of 8 queries counted from each sequence's start (13, 59) straddle the shards'
    boundaries: each shard's top-k scores them from every query (scoring_query) and keeps its
    own rows' selections. GQA group 2."""
    check_per_block_groups(rng, heads_q=4, heads_kv=2, platform=PLATFORM)


# ---- several batch rows ------------------------------------------------------------------------


def test_nsa_shards_of_three_batch_rows_in_one_launch_per_kernel(rng, monkeypatch):
    """Full NSA on shards of 3 batch rows of 75 tokens (a decoding step's single row among them):
    the paper reference's outputs, selections and gradients, and one pallas_call per kernel for
    the three rows, as for one."""
    check_batch_row_shards(rng, monkeypatch, platform=PLATFORM)


def test_table_branches_on_shards_of_two_batch_rows(rng):
    """Table branches, bidirectional, on shards of 2 batch rows."""
    check_batch_row_tables(rng, platform=PLATFORM)


# ---- lowering, and the TPU variant -------------------------------------------------------------


def test_kernels_of_a_shard_lower_to_triton_for_a_gpu(rng, monkeypatch):
    """Without a GPU here, lower (not run) a shard's forward and backward for CUDA, in bfloat16,
    with a traced offset: every kernel (compression, top-k, selection, sliding window; their dq
    and dk/dv) must go through Pallas' Triton lowering with the shard's index arithmetic."""
    plan = nsa_dsl.compile(NSA).plan
    module = generated(plan)
    monkeypatch.setattr(module, "ON_GPU", True)
    monkeypatch.setattr(module, "POWER_OF_TWO_TILES", True)
    seq_len, shard_len = 96, 32
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in qkv(rng, 1, seq_len, 6, 2, 24))
    gates = {f"g_{name}": jnp.asarray(gate(rng, 1, shard_len, 6), jnp.bfloat16) for name in ("cmp", "slc", "swa")}
    tables = dispatch.branch_tables(plan, seq_len)

    def loss(q_rows, k, v, offset):
        out = module.attention(q_rows, k, v, gates=gates, tables=tables, cu_seqlens=None, softmax_scale=0.2,
                               query_offset=offset)
        return jnp.sum(out.astype(jnp.float32))

    for function, kernels in ((loss, 4), (jax.grad(loss, argnums=(0, 1, 2)), 10)):
        lowered = lower_for_cuda(jax.jit(function), q[:, :shard_len], k, v, jnp.int32(32))
        assert lowered.as_text().count("__gpu$xla.gpu.triton") == kernels


def test_the_tpu_variant_refuses_a_shard(rng):
    """The TPU (Mosaic) variant maps query rows to key rows one to one: a shard of the queries is
    refused, naming the platforms that take one."""
    tpu = NativeSparseAttentionConfig(backend="tpu")
    q, k, v = qkv(rng, 1, 64, 2, 1, 16)
    gates = {name: gate(rng, 1, 32, 2) for name in ("g_cmp", "g_slc", "g_swa")}
    with pytest.raises(NotImplementedError, match="pallas backend on TPU; here 'xla' supports it"):
        attend(nsa_dsl.compile(NSA).plan, q[:, 32:], k, v, gates=gates, query_offset=32, platform=PLATFORM,
               config=tpu)
