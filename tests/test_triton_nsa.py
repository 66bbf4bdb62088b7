"""Native Sparse Attention on the Triton platform (compression attention, on-device top-k,
selection, sliding window, gates), its kernels run in Triton's interpreter on the CPU, against
the float64 reference written from the paper's equations (tests/nsa_reference.py): selections
(by the reference's scores of the chosen blocks, so exact ties may differ), outputs, and the
gradients of q, k, v, every gate, the softmax scale and learned pooling weights; both NSA
examples, odd lengths, GQA groups 1/2/3/4/16/17/24, head dims 20/32/60/100/192, packed sequences,
`per block(Q)` selection, forced blocks, a top-k split into shares, float32 and float16. The
interpreter runs one program at a time in Python: shapes are tiny."""

from __future__ import annotations

import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from conftest import (
    assert_close,
    gate,
    launched_triton_kernels,
    lower_for_cuda,
    normal,
    qkv,
    random_indices,
    record_calls,
    triton_launches,
)
from nsa_check import (
    TOLERANCE,
    check_against_reference,
    check_compression_against_reference,
    compression_source,
)
from nsa_reference import (
    NsaSpec,
    chosen_scores,
    compressed_kv,
    dense_operators,
    nsa_reference,
    small_example,
)

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.runtime import dispatch, layout, triton_glue
from nsa_dsl.runtime.platform import for_device

triton_glue.prepare_kernels()  # before triton's import: without a GPU, its interpreter
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@pytest.mark.parametrize(
    "example, seq_len, heads_q, heads_kv, head_dim",
    [
        # lengths past count + 1 blocks of 16, so that the top-k leaves blocks out
        ("nsa", 101, 3, 1, 20),  # group 3, head dim 20: overlapping compression, three branches (one static)
        ("nsa_meanpool", 77, 16, 1, 60),  # group 16, head dim 60
        ("nsa", 85, 24, 1, 16),  # group 24: 32 head slots a token, 8 of them padding
    ],
)
def test_examples_match_the_paper(rng, example, seq_len, heads_q, heads_kv, head_dim):
    source, spec = small_example(example)
    gates = ("cmp", "slc", "swa") if example == "nsa" else ("cmp", "slc")
    check_against_reference(rng, source, spec, batch=1, seq_len=seq_len, heads_q=heads_q, heads_kv=heads_kv,
                            head_dim=head_dim, gates=gates)


@pytest.mark.parametrize(
    "example, seq_len, heads_q, heads_kv, head_dim, dtype, cu_seqlens",
    [
        # sequences past count + 1 blocks of 16, so that the top-k leaves blocks out
        ("nsa_meanpool", 90, 16, 1, 192, np.float32, [0, 5, 90]),  # group 16, head dim 192 (padded to 256)
        ("nsa", 96, 17, 1, 100, np.float16, [0, 7, 92]),  # group 17, head dim 100, rows past the last
    ],
)
def test_examples_on_packed_sequences_at_the_issues_head_dims(rng, example, seq_len, heads_q, heads_kv, head_dim,
                                                              dtype, cu_seqlens):
    """Both NSA examples (compression, top-k on device, per-token selection, and the window) on
    packed sequences of odd lengths, at head dims 192 and 100 (no power of two) and groups of 16 and
    17: selections, output and the gradients of q, k, v, every gate and the scale, float32 and
    float16."""
    source, spec = small_example(example)
    gates = ("cmp", "slc", "swa") if example == "nsa" else ("cmp", "slc")
    check_against_reference(rng, source, spec, batch=1, seq_len=seq_len, heads_q=heads_q, heads_kv=heads_kv,
                            head_dim=head_dim, dtype=dtype, cu_seqlens=cu_seqlens, gates=gates)


def test_packed_sequences_with_learned_pooling(rng):
    source = (
        "pattern p\nblock 16\n"
        "branch cmp = compress(block=8, stride=4, pool=learned) gate g_cmp\n"
        "branch slc = topk(3, block=16, score=cmp, force=local(1)) gate g_slc\n"
    )
    spec = NsaSpec(compress_block=8, compress_stride=4, select_count=3, select_block=16,
                   forced=lambda qb, kb: kb == qb, pool_weights=tuple(rng.uniform(0.0, 0.3, 8)))
    # Group 1, two KV heads; a sequence too short to compress; rows 88.. in no sequence.
    check_against_reference(rng, source, spec, batch=1, seq_len=90, heads_q=2, heads_kv=2, head_dim=16,
                            cu_seqlens=[0, 6, 25, 88], gates=("cmp", "slc"), softmax_scale=0.4)


FORCE_FIRST, FORCE_OWN = ("global(first=1)", lambda qb, kb: kb < 1), ("local(1)", lambda qb, kb: kb == qb)


# The functions of a generated module whose launch split_walks can split.
SPLIT_CALLERS = ("topk_blocks", "_compression_forward")


@pytest.fixture
def split_walks(monkeypatch):
    """split_walks(module, splits, caller): the launch that the module's function `caller` makes
    (topk_blocks: the top-k, its shares' keys merged by topk_merge; _compression_forward: the
    compression's forward, its shares' out and lse merged by merge_splits) splits each tile's walk
    over keys into `splits` shares (no more than the walk has steps; key_splits' own choice needs
    fewer than SPLIT_PROGRAMS programs and MIN_SPLIT_STEPS = 4 steps a share: a decoding step's);
    other launches keep key_splits' choice (a second call, for the other caller, splits both).
    Returns the list of that launch's splits, one entry per trace."""

    def split(module, splits, caller):
        assert caller in SPLIT_CALLERS, caller
        taken = []
        key_splits = module.key_splits

        def splitting(programs, steps, min_steps):
            if sys._getframe(1).f_code.co_name != caller:
                return key_splits(programs, steps, min_steps)
            taken.append(min(splits, steps))
            return taken[-1]

        monkeypatch.setattr(module, "key_splits", splitting)
        dispatch.kernel.cache_clear()  # no trace of the unsplit launch may serve
        jax.clear_caches()
        return taken

    yield split
    dispatch.kernel.cache_clear()  # nor may a later test reuse a split one
    jax.clear_caches()


@pytest.mark.parametrize(
    "compress_block, compress_stride, seq_len, heads_q, cu_seqlens, force, head_dim, splits",
    [
        # overlapping keys: 7 blocks a chunk; the second's best interleave with the first's
        (16, 8, 200, 2, None, FORCE_FIRST, 16, 1),
        # the walk's first chunk, whose first key starts before the sequence, is masked; block 0 is not forced
        (16, 8, 260, 2, [0, 40, 260], FORCE_OWN, 16, 1),
        (16, 16, 300, 1, [0, 21, 300], FORCE_FIRST, 16, 1),  # one key per block: 16 blocks a chunk; group 1, packed
        # Split top-k (split_walks), GQA 3, head dim 20: 19 blocks of 7-block chunks in 3 shares of
        # 7, 7 and 5 blocks (a tile's walk up to its last group's block: later shares short or
        # empty, fewer candidates than picks); the forced block in the first share.
        (16, 8, 301, 3, None, FORCE_FIRST, 20, 3),
        # 21 blocks in 2 shares of two chunks (14 blocks) and one; each row's own block forced,
        # in whichever share holds it.
        (16, 8, 333, 2, None, FORCE_OWN, 20, 2),
        # One key per block, packed: the second sequence's 18 blocks in shares of 16 and 2 (fewer
        # than the 3 picks), the first sequence's rows in the first share only.
        (16, 16, 333, 2, [0, 45, 333], FORCE_OWN, 24, 2),
    ],
)
def test_topk_merges_chunks_of_candidate_blocks(request, rng, compress_block, compress_stride, seq_len, heads_q,
                                                cu_seqlens, force, head_dim, splits):
    """block_k=16 makes the top-k walk a long sequence's blocks in several chunks, each merged into
    the running best; chunks that every row of a tile sees whole are ranked unmasked. With splits >
    1 the walk splits into shares (split_walks), whose keys topk_merge merges, as a decoding step's
    do. Selections and output (the other tests differentiate shorter sequences)."""
    source = (
        "pattern p\nblock 16\n"
        f"branch cmp = compress(block={compress_block}, stride={compress_stride}) gate g_cmp\n"
        f"branch slc = topk(3, block=16, score=cmp, force={force[0]}) gate g_slc\n"
    )
    spec = NsaSpec(compress_block=compress_block, compress_stride=compress_stride, select_count=3, select_block=16,
                   forced=force[1])
    config = nsa_dsl.NativeSparseAttentionConfig(block_size=16, block_k=16)
    if splits > 1:
        attn = nsa_dsl.compile(source, config=config)
        module = codegen.load_module("triton", attn.plan, for_device(attn.config))
        taken = request.getfixturevalue("split_walks")(module, splits, "topk_blocks")
    check_against_reference(rng, source, spec, batch=1, seq_len=seq_len, heads_q=heads_q, heads_kv=1,
                            head_dim=head_dim, cu_seqlens=cu_seqlens, gates=("cmp", "slc"), config=config,
                            gradients=False)
    if splits > 1:
        assert taken and set(taken) == {splits}, f"the top-k took {taken} splits"


@pytest.mark.parametrize(
    "block, stride, batch, seq_len, heads_q, heads_kv, head_dim, cu_seqlens, spans, splits",
    [
        # 100 keys: forward steps of 32 (the last of 4), a last token past every key's end; dk/dv in 3 spans of 68 rows
        (4, 2, 1, 203, 6, 2, 20, None, 3, 1),
        # two batch rows of 71 keys (a tile walks both), l = 4d; 298 rows: 4 spans of 75
        (8, 2, 2, 149, 4, 1, 36, None, 4, 1),
        # packed sequences of 45 and 145 tokens (36 keys), rows past 190 in none; group 3, l = d
        (4, 4, 1, 211, 3, 1, 24, [0, 45, 190], 3, 1),
        # The forward split (split_walks) into 3 shares, merged by merge_splits; GQA 3 (16-token
        # tiles). 149 keys in 5 steps of 32: the last tiles' walks in shares of 2, 2 and 1 steps (the
        # last of 21 keys); walks of 3 steps in shares of one step each (the last partial); walks
        # of one, two or four steps leave the last shares empty (lse -inf), the first tiles' two.
        (4, 2, 1, 301, 6, 2, 20, None, 4, 3),
        # Packed sequences of 37 and 213 tokens (17 and 105 keys), rows past 250 in none, GQA 2,
        # in 2 shares: the second sequence's last tile walks its 105 keys (4 steps, the last of 9
        # keys) in shares of 64 and 41; a tile across both sequences walks keys 0-28 in one share,
        # the second empty; the last tile (rows in no sequence) walks none.
        (4, 2, 1, 263, 4, 2, 24, [0, 37, 250], 4, 2),
        # Two batch rows of 71 keys (3 steps, the last of 7), GQA 2, in 2 shares of 2 steps and 1;
        # the tile across the batch rows walks 73 keys (64 and 9).
        (8, 2, 2, 149, 4, 2, 16, None, 4, 2),
    ],
)
def test_compression_attention_over_several_key_steps_and_query_spans(request, monkeypatch, rng, block, stride, batch,
                                                                      seq_len, heads_q, heads_kv, head_dim, cu_seqlens,
                                                                      spans, splits):
    """The compression branch alone (compression_forward, its dq and dk/dv), output and gradients
    against the float64 dense reference on inputs whose scores rise along the sequence (each step
    of a query's walk over the compressed keys finds a new maximum: the online softmax must rescale
    what it summed), lengths no multiple of the stride (a last, partial step of keys, rows masked
    in it), and enough query rows that the dk/dv kernel sums each key tile's gradients over
    several spans of query rows (the grid's third axis, checked), as a long sequence does. With
    splits > 1 the forward splits each tile's walk into shares (split_walks, the grid's third
    axis, checked) as a decoding step's does, whose out and lse merge_splits merges: the merged
    lse also feeds the backward, which does not split."""
    if splits > 1:
        attn = nsa_dsl.compile(compression_source(block, stride))
        module = codegen.load_module("triton", attn.plan, for_device(attn.config))
        taken = request.getfixturevalue("split_walks")(module, splits, "_compression_forward")
        merged = record_calls(monkeypatch, module, "merge_splits")
    launches = triton_launches(monkeypatch, lambda: check_compression_against_reference(
        rng, block=block, stride=stride, batch=batch, seq_len=seq_len, heads_q=heads_q, heads_kv=heads_kv,
        head_dim=head_dim, cu_seqlens=cu_seqlens))
    dkdv = [grid for name, grid in launches if name == "compression_backward_dkdv"]
    assert dkdv and all(grid[2] == spans for grid in dkdv), launches
    forward = [grid for name, grid in launches if name == "compression_forward"]
    assert forward and all(grid[2] == splits for grid in forward), launches
    if splits > 1:
        assert taken and set(taken) == {splits}, f"the compression forward took {taken} splits"
        assert len(merged) == len(forward), f"{len(forward)} split forwards, {len(merged)} merges"


def test_selection_per_block_of_queries_in_float16(rng):
    source = (
        "pattern p\nblock 16\n"
        "branch cmp = compress(block=16, stride=8) gate g_cmp\n"
        "branch slc = topk(3, block=16, score=cmp, force=global(first=1)) per block(8) gate g_slc\n"
    )
    spec = NsaSpec(compress_block=16, compress_stride=8, select_count=3, select_block=16, query_block=8,
                   forced=lambda qb, kb: kb < 1)
    # Group 2, head dim 100, two batch rows of odd length.
    check_against_reference(rng, source, spec, batch=2, seq_len=61, heads_q=2, heads_kv=1, head_dim=100,
                            dtype=np.float16, gates=("cmp", "slc"))


@pytest.mark.parametrize(
    "query_block, heads_q, heads_kv, cu_seqlens, score_gradients",
    [
        (4, 3, 1, [0, 5, 31, 88], "stored"),
        (16, 16, 1, [0, 21, 88], "stored"),
        (16, 16, 1, [0, 21, 88], "recomputed"),
        (4, 6, 2, [0, 5, 31, 88], "stored in head slices"),
    ],
)
def test_groups_of_queries_share_each_loaded_block(request, rng, query_block, heads_q, heads_kv, cu_seqlens,
                                                   score_gradients):
    """`per block(Q)` selections run as block-sparse attention: a forward or dq program takes
    several tokens of one group and loads each of the group's blocks once for all of them (Q = 4,
    group 3: the group's 4 tokens of 4 head rows; Q = 16, group 16: 4 tokens a program, a group in
    4 programs); dk/dv walk the groups that selected their block (4 groups of 4 tokens a step; a
    group in 4 steps of 4 tokens). On packed sequences that do not end on a group's edge, rows past
    the last one; dq reading the stored score gradients, or recomputing them, or reading them a
    slice of KV heads at a time (each slice's launches writing on the gradients the slice before
    wrote, which the first zeroed where rows belong to no group)."""
    if score_gradients == "recomputed":
        request.getfixturevalue("recomputed_scores")
    if score_gradients == "stored in head slices":
        asked = request.getfixturevalue("scores_in_head_slices")
    source = (
        "pattern p\nblock 16\ncausal\n"
        "branch cmp = compress(block=8, stride=8) gate g_cmp\n"
        f"branch slc = topk(3, block=16, score=cmp, force=local(1)) per block({query_block}) gate g_slc\n"
    )
    spec = NsaSpec(compress_block=8, compress_stride=8, select_count=3, select_block=16, query_block=query_block,
                   forced=lambda qb, kb: kb == qb)
    check_against_reference(rng, source, spec, batch=1, seq_len=91, heads_q=heads_q, heads_kv=heads_kv, head_dim=24,
                            cu_seqlens=cu_seqlens, gates=("cmp", "slc"))
    if score_gradients == "stored in head slices":
        assert asked[0] // 2 in asked, "the backward did not try slices of half the KV heads"


@pytest.mark.skipif(not triton_glue.on_gpu(), reason="pipelining: the interpreter ignores num_stages")
@pytest.mark.parametrize("num_warps, num_stages", [(4, 1), (8, 3)])
def test_launch_settings_at_both_ends_of_the_autotuners_range(rng, num_warps, num_stages):
    """Tiles of tokens that see no compressed key (the first l - 1 of a sequence) once started the
    compression walks at a sentinel near 2**31: with 3 stages Triton's pipeline guard of the
    steps ahead overflowed and the H200 read outside k_cmp (CUDA_ERROR_ILLEGAL_ADDRESS)."""
    source, spec = small_example("nsa_meanpool")
    config = nsa_dsl.NativeSparseAttentionConfig(num_warps=num_warps, num_stages=num_stages)
    check_against_reference(rng, source, spec, batch=1, seq_len=150, heads_q=16, heads_kv=1, head_dim=64,
                            cu_seqlens=[0, 9, 75, 150], config=config)


def test_native_sparse_attention_with_g_cmp(rng):
    batch, seq_len, heads_q, heads_kv, head_dim, block = 1, 35, 4, 1, 32, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    g_cmp, g_slc = gate(rng, batch, seq_len, heads_q), gate(rng, batch, seq_len, heads_q)
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=block)
    out = nsa_dsl.native_sparse_attention(q, k, v, g_cmp, g_slc, None, 2, None, platform="triton", cfg=cfg)
    plan = nsa_dsl.api.compressed_selection_plan(block, 2)
    chosen = np.asarray(nsa_dsl.runtime.selections(plan, q, k, v, platform="triton")["slc"])
    spec = NsaSpec(compress_block=block, compress_stride=block, select_count=2, select_block=block,
                   forced=lambda qb, kb: kb == qb)
    _, _, ref_chosen, scores = nsa_reference(q, k, v, spec, gates={"cmp": g_cmp, "slc": g_slc})
    np.testing.assert_allclose(chosen_scores(scores, chosen), chosen_scores(scores, ref_chosen), rtol=1e-4, atol=1e-6)
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates={"cmp": g_cmp, "slc": g_slc}, selected=chosen)
    assert_close(out, expected, TOLERANCE[np.float32][0], "output")


@pytest.mark.parametrize("gates, slc_gate, by_key_block", [
    (("g_cmp", "g_swa"), "gate g_slc", False),
    (("g_slc",), "gate g_slc", False),
    (("g_cmp", "g_slc", "g_swa", "g_near"), "gate g_slc", False),
    (("g_cmp", "g_slc", "g_swa", "g_near"), "gate g_slc", True),
    (("g_cmp", "g_swa"), "gate g_slc default 0.5", False),
    (("g_cmp", "g_swa"), "gate g_slc default 0.5", True),
    (("g_swa",), "", False),
])
def test_the_selection_kernel_writes_every_branchs_gated_output(rng, monkeypatch, request, gates, slc_gate,
                                                                by_key_block):
    """examples/nsa.nsa scaled down, with a second window (g_near): called without gradients, the
    selection branch's kernel adds the other branches' gated outputs as it writes the result (a
    third one summed first: the kernel takes two), in one launch instead of the selection's own,
    its own weighed by its gate, the gate's default when not passed, or 1 for a branch without one;
    without g_slc (no default) the other branches' outputs are summed. The terms that come weighed
    already (the fused launch's, the sum of the rest) are added unweighted. `by_key_block`: the
    selection runs key block by key block and gated_merge adds the terms as it merges the parts.
    Group 4, head dim 24, odd length."""
    if by_key_block:
        request.getfixturevalue("block_outer_forward")
    source, spec = small_example("nsa")
    source = source.replace("\ncausal\n", "\ncausal\ngate g_near\n").replace(" gate g_slc\n", f" {slc_gate}\n")
    source += "branch near = window(8) gate g_near\n"
    batch, seq_len, heads_q, heads_kv, head_dim = 1, 45, 8, 2, 24
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    values = {name: gate(rng, batch, seq_len, heads_q) for name in gates}
    attn = nsa_dsl.compile(source)
    call = jax.jit(lambda q, k, v, values: attn(q, k, v, platform="triton", **values))
    launched = launched_triton_kernels(monkeypatch, lambda: jax.make_jaxpr(call)(q, k, v, values))
    out = call(q, k, v, values)
    selection_runs = "g_slc" in gates or slc_gate != "gate g_slc"
    assert launched.count("gated_merge" if by_key_block else "gated_selection_forward") == selection_runs, launched
    assert "selection_forward" not in launched

    chosen = np.asarray(attn.selections(q, k, v, platform="triton")["slc"])
    references = {name[2:]: value for name, value in values.items() if name != "g_near"}
    if "g_slc" not in gates and selection_runs:
        references["slc"] = np.full((batch, seq_len, heads_q), 0.5 if "default" in slc_gate else 1.0)
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates=references, selected=chosen)
    if "g_near" in values:
        expected += nsa_reference(q, k, v, replace(spec, window=8), gates={"swa": values["g_near"]}, selected=chosen)[0]
    assert_close(out, expected, TOLERANCE[np.float32][0], "output")



@pytest.mark.parametrize("by_key_block", [False, True], ids=["token by token", "key block by key block"])
def test_the_selection_kernel_weighs_each_other_branch_by_its_own_gate(rng, monkeypatch, request, by_key_block):
    """A compression and a table-form static branch beside the top-k, each gated: not
    differentiated, the selection's kernel adds two terms each weighed by its own gate (in the NSA
    examples the window and the compression make one term, weighed already). Token by token
    (gated_selection_forward) or key block by key block (gated_merge); group 2 over two KV heads,
    odd length."""
    if by_key_block:
        request.getfixturevalue("block_outer_forward")
    source = ("pattern p\nblock 16\ncausal\ngate g_far\n"
              "branch cmp = compress(block=8, stride=4) gate g_cmp\n"
              "branch slc = topk(3, block=16, score=cmp, force=local(1)) gate g_slc\n"
              "branch far = global(first=1) | random(1, seed=3) gate g_far\n")
    spec = NsaSpec(compress_block=8, compress_stride=4, select_count=3, select_block=16, forced=FORCE_OWN[1])
    batch, seq_len, heads_q, heads_kv, head_dim = 1, 53, 4, 2, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    values = {name: gate(rng, batch, seq_len, heads_q) for name in ("g_cmp", "g_slc", "g_far")}
    attn = nsa_dsl.compile(source)
    call = jax.jit(lambda q, k, v, values: attn(q, k, v, platform="triton", **values))
    epilogues, launch = [], triton_glue.launch

    def recording(kernel, grid, *args, **constants):
        if kernel.__name__ in ("gated_selection_forward", "gated_merge"):
            epilogues.append({name: constants[name] for name in ("TERMS", "WEIGHTED_0", "WEIGHTED_1")})
        return launch(kernel, grid, *args, **constants)

    monkeypatch.setattr(triton_glue, "launch", recording)
    out = call(q, k, v, values)
    assert epilogues == [{"TERMS": 2, "WEIGHTED_0": True, "WEIGHTED_1": True}], epilogues

    chosen = np.asarray(attn.selections(q, k, v, platform="triton")["slc"])
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates={"cmp": values["g_cmp"], "slc": values["g_slc"]},
                                      selected=chosen)
    far = next(branch.keys for branch in attn.pattern.branches if branch.name == "far")
    mask = reference.static_mask(far, 16, True, batch, seq_len)
    expected += reference.forward(q, k, v, [mask], [values["g_far"]], head_dim**-0.5)
    assert_close(out, expected, TOLERANCE[np.float32][0], "output")

@triton.jit
def walk_chunks(scores, valid, kept, keep_best: tl.constexpr, block_of: tl.constexpr, CHUNKS: tl.constexpr,
                CHUNK: tl.constexpr, COUNT: tl.constexpr):
    """Rows [4 * program, 4 * program + 4) of scores [rows, CHUNKS * CHUNK] (candidate blocks, used
    where valid): the ids of their COUNT best, best first (-1: none), by the top-k's running best
    over chunks of CHUNK candidates."""
    row = tl.program_id(0) * 4 + tl.arange(0, 4)
    best = -1.0 - (row[:, None] * 0 + tl.arange(0, COUNT)[None, :]).to(tl.float64)  # empty slots
    for c in range(CHUNKS):
        chunk_at = row[:, None] * (CHUNKS * CHUNK) + c * CHUNK + tl.arange(0, CHUNK)[None, :]
        best = keep_best(best, tl.load(scores + chunk_at), tl.load(valid + chunk_at) != 0, c * CHUNK, COUNT, CHUNK)
    tl.store(kept + row[:, None] * COUNT + tl.arange(0, COUNT)[None, :], block_of(best))


@pytest.mark.parametrize("block, stride, head_dim, dtype, cu_seqlens", [
    (16, 16, 60, np.float32, None),  # NSA's l = d, a head dim that is no power of two, batch rows
    (32, 16, 24, np.float16, np.array([0, 7, 60, 95, 130])),  # overlapping blocks; a sequence with none
    (24, 8, 32, np.float32, np.array([0, 50, 101])),  # a block that is no power of two, 3 keys a token
])
def test_mean_pool_matches_the_reference(rng, block, stride, head_dim, dtype, cu_seqlens):
    """The Triton module's mean pooling (one mean_pool launch) on fresh random keys and values
    against the float64 reference's (nsa_reference.compressed_kv of each sequence and head, in
    the rows layout.compressed_offsets gives them), zeros past every sequence's keys, and through
    its custom_vjp the gradients of that linear map (the transpose of the reference's dense
    pooling matrix, nsa_reference.dense_operators)."""
    source = (f"pattern p\nblock 16\nbranch c = compress(block={block}, stride={stride})\n"
              "branch s = topk(2, block=16, score=c)")
    module = codegen.load_module("triton", nsa_dsl.compile(source).plan, for_device(None))
    batch, seq_len = (2, 65) if cu_seqlens is None else (1, int(cu_seqlens[-1]))
    offsets = layout.sequence_offsets(cu_seqlens, batch, seq_len)
    k, v = (rng.standard_normal((batch * seq_len, 3, head_dim)).astype(dtype) for _ in range(2))
    spec = NsaSpec(compress_block=block, compress_stride=stride, select_count=2, select_block=16)
    bounds = np.asarray(offsets)
    pool, _ = dense_operators(spec, 1, batch * seq_len, bounds)  # [C, N]: row c averages compressed key c's tokens
    live = pool.shape[0]

    def reference(x):  # [N, HKV, D] -> [live, HKV, D]: compressed_kv pools k and v alike
        x = np.asarray(x, np.float64)
        return np.concatenate([np.stack([compressed_kv(x[start:end, h], x[start:end, h], spec)[0]
                                         for h in range(x.shape[1])], axis=1)
                               for start, end in zip(bounds[:-1], bounds[1:])])

    pooled = jax.jit(lambda k, v: tuple(module.pool_mean(k, v, offsets, block, stride, k.dtype)[:2]))
    got, pullback = jax.vjp(pooled, k, v)
    tolerance = 1e-6 if dtype == np.float32 else 1e-3
    for got_rows, x in zip(got, (k, v)):
        assert got_rows.dtype == dtype and live < got_rows.shape[0]
        np.testing.assert_allclose(np.asarray(got_rows[:live], np.float64), reference(x), rtol=tolerance,
                                   atol=tolerance)
        assert not np.asarray(got_rows[live:]).any()
    cotangents = tuple(rng.standard_normal(x.shape).astype(dtype) for x in got)
    for got_d, d_pooled in zip(pullback(cotangents), cotangents):
        want_d = np.einsum("cn,chd->nhd", pool, np.asarray(d_pooled[:live], np.float64))
        assert got_d.dtype == dtype
        np.testing.assert_allclose(np.asarray(got_d, np.float64), want_d, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(triton_glue.on_gpu(), reason="numpy buffers: Triton's interpreter only")
def test_keep_best_keeps_the_best_blocks_of_every_chunk(rng):
    """The top-k's running best (keep_best) over chunks of candidate blocks, against numpy's sort by
    score, the lower id first on exact ties: scores in random order (2**-10 apart at least: well
    past the chunk keys' 2**-16, CHUNK_KEY_BIAS), in ascending order (every chunk beats all kept
    blocks), densely spaced, with exact ties within and across chunks, forced blocks (+inf) and zeros, and valid
    candidates only in the first or only in the last chunks, or in fewer than `count`."""
    source = "pattern p\nblock 16\nbranch c = compress(block=16, stride=16)\nbranch s = topk(16, block=16, score=c)"
    module = codegen.load_module("triton", nsa_dsl.compile(source).plan, for_device(None))
    rows, chunks, chunk, count = 24, 12, 64, 16
    blocks = chunks * chunk
    scores = 2.0 ** (rng.permutation(rows * blocks).reshape(rows, blocks) / 1024 - 20).astype(np.float32)
    valid = np.ones((rows, blocks), np.int32)
    scores[0] = 1.0 + rng.permutation(blocks) * 2.0**-14  # dense: 4 of the chunk keys' steps (2**-16) apart
    scores[1] = np.sort(scores[1])
    valid[2, 5 * chunk:] = 0  # no valid candidate after chunk 5
    valid[6, : 6 * chunk] = 0  # valid candidates only from chunk 6
    scores[3] = scores[3, rng.integers(0, 40, blocks)]  # 40 values: exact ties everywhere
    scores[4, rng.choice(blocks, 20, replace=False)] = np.inf  # more forced blocks than are kept
    scores[5, rng.choice(blocks, blocks // 2, replace=False)] = 0.0
    valid[7] = 0
    valid[7, rng.choice(blocks, 9, replace=False)] = 1  # fewer candidates than kept slots
    # The best blocks all in the first chunk, consecutive ranks one of its keys' steps apart (2**-15
    # from 2 on: 2**-16 of the score): a chunk key twice as coarse ties ranks 16 and 17, and ranks
    # them by place, wrongly in about one row of two.
    scores[8:, :chunk] = 2.0 + (1 + np.stack([rng.permutation(chunk) for _ in range(rows - 8)])) * 2.0**-15
    kept = np.zeros((rows, count), np.int32)
    walk_chunks[(rows // 4,)](
        triton_glue.HostBuffer(scores), triton_glue.HostBuffer(valid), triton_glue.HostBuffer(kept), module.keep_best,
        module.block_of, chunks, chunk, count)
    for row in range(rows):
        ids = np.flatnonzero(valid[row])
        best = ids[np.lexsort((ids, -scores[row, ids].astype(np.float64)))][:count]
        np.testing.assert_array_equal(kept[row], np.pad(best, (0, count - best.size), constant_values=-1), str(row))


@pytest.mark.parametrize("platform", ["triton", "pallas"])
def test_backward_traces_no_scatter(rng, platform):
    """The paper's NSA scaled down (compressed blocks overlapping: stride 4 < block 8), packed sequences: its
    backward is kernels and gathers only. XLA's scatter-add sums repeated indices with atomics on a
    GPU, so two backward passes would differ (gpu_check's "repeat" column found the pooling's)."""
    source, _ = small_example("nsa")
    attn = nsa_dsl.compile(source)
    q, k, v = qkv(rng, 1, 70, 4, 2, 32)
    g = {name: gate(rng, 1, 70, 4) for name in ("g_cmp", "g_slc", "g_swa")}
    cu = np.array([0, 29, 70], np.int32)
    loss = lambda q, k, v, g: jnp.sum(attn(q, k, v, cu_seqlens=cu, platform=platform, **g) * q)  # noqa: E731
    backward = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, g))
    assert "scatter" not in backward


# Every plan feature's Triton module, and a call that differentiates it (q, k, v, gates, rng).
_STATIC = ("pattern p\nblock 16\ncausal\ngate g_sink\nbranch swa = window(20) gate g_swa\n"
           "branch sink = global(first=1) | stride(every=3) gate g_sink\nbranch far = random(1, seed=4) - local(1)\n")
_PER_BLOCK = ("pattern p\nblock 16\ncausal\nbranch cmp = compress(block=8, stride=8) gate g_cmp\n"
              "branch slc = topk(3, block=16, score=cmp, force=local(1)) per block(8) gate g_slc\n")
_LEARNED = ("pattern p\nblock 16\nbranch cmp = compress(block=8, stride=4, pool=learned) gate g_cmp\n"
            "branch slc = topk(3, block=16, score=cmp) gate g_slc\n")


def _explicit_selection(q, k, v, g, rng, cu):
    indices = random_indices(rng, 1, q.shape[1], k.shape[2], 3, 16, cu)
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=16)
    return nsa_dsl.native_sparse_attention(q, k, v, None, g["g_slc"], indices, 2, cu, platform="triton", cfg=cfg)


def _compiled(source, **options):
    attn = nsa_dsl.compile(source)
    return attn.plan, lambda q, k, v, g, rng, cu: attn(q, k, v, cu_seqlens=cu, platform="triton", **options, **g)


@pytest.mark.parametrize("feature", ["static ranges and a table", "per block(Q)", "learned pooling", "explicit"])
def test_every_features_backward_is_kernels_without_atomics(rng, feature):
    """The Triton issue's backward for every plan feature: dq, dk, dv and the gates' gradients by
    kernels that use no atomics (the generated module names none) and by XLA operations without
    scatter-add (which XLA runs with atomics on a GPU): deterministic (gpu_check's "repeat" column
    checks two backward passes bitwise on a GPU; the interpreter runs programs one at a time, so
    CI can only read the program). Traced, not run; packed sequences, group 2."""
    if feature == "explicit":
        plan, call = nsa_dsl.kernel.selection_plan(16), _explicit_selection
    elif feature == "learned pooling":
        pool = {"cmp": lambda kb, vb: (kb.mean(1), vb.mean(1))}
        plan, call = _compiled(_LEARNED, pool_fns=pool)
    else:
        plan, call = _compiled(_STATIC if feature.startswith("static") else _PER_BLOCK)
    source = codegen.source("triton", plan, for_device(None))
    assert "@triton.jit" in source and "atomic" not in source.replace("without atomics", "")
    q, k, v = qkv(rng, 1, 70, 4, 2, 32)
    names = sorted({branch.gate.name for branch in plan.branches if branch.gate is not None})
    g = {name: gate(rng, 1, 70, 4) for name in names}
    cu = np.array([0, 29, 70], np.int32)

    def loss(q, k, v, g):
        return jnp.sum(call(q, k, v, g, rng, cu) * q)

    backward = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, g))
    assert "pure_callback" in backward or "triton" in backward  # the kernels ran
    assert "scatter" not in backward


# ---- the compression's forward on Hopper (templates/triton/hopper_window.py.j2) ----------------

COMPRESSION_ONLY = "pattern p\nblock 64\ncausal\nbranch cmp = compress(block={}, stride={}) gate g_cmp\n"


def compression_module(block, stride, topk=""):
    attn = nsa_dsl.compile(COMPRESSION_ONLY.format(block, stride) + topk)
    return codegen.load_module("triton", attn.plan, for_device(attn.config))


TOPK = "branch slc = topk(4, block=64, score=cmp, force=local(1)) gate g_slc\n"


@pytest.mark.parametrize("heads", [1, 16])
@pytest.mark.parametrize("block, stride, seq_len", [(64, 64, 1024), (32, 16, 1000), (256, 64, 1024), (64, 32, 8),
                                                    (16, 16, 4096), (200, 8, 2000)])
def test_hopper_compression_walks_every_seen_key_and_masks_only_partly_seen_steps(block, stride, seq_len, heads):
    """The Hopper forward's schedule of compressed keys, which CI cannot run: each query tile walks
    every key its rows see (no step past the bound that sizes its buffers), the steps it runs
    without a mask hold only keys every row of the warpgroup sees, and the mask on the others is
    layout.seen_compressed's prefix; rows before the first key's last token see none. Rows of one
    head (hopper_compression_forward) or of a KV group's 16 heads, 4 tokens a warpgroup
    (hopper_window_and_compression_forward)."""
    module = compression_module(block, stride)
    keys = module._CompressedKeys(block, stride, seq_len)
    rows, step = module.HOPPER_BLOCK_Q // heads, module.HOPPER_BLOCK_KV
    padded = -(-seq_len // (2 * rows)) * 2 * rows
    count = int(np.asarray(layout.compressed_offsets(jnp.asarray([0, seq_len], jnp.int32), block, stride))[1])
    assert keys.count == count
    q_pos = np.arange(seq_len)[:, None]
    k_pos = np.arange(-(-max(count, 1) // step) * step + step)[None, :]
    sees = (k_pos * stride + block - 1 <= q_pos) & (k_pos < count)
    assert (np.asarray(keys.sees(q_pos, k_pos)) == (k_pos * stride + block - 1 <= q_pos)).all()
    assert (sees.sum(1) == np.asarray(layout.seen_compressed(jnp.arange(seq_len), block, stride))).all()
    assert keys.empty_rows and not sees[: block - 1].any()
    walk = module._Rows(heads, step, halves=True)
    for tile_first in range(0, padded, 2 * rows):
        tile_rows = sees[tile_first : tile_first + 2 * rows]
        first_key, whole, steps, short = (int(x) for x in module._item_walk(keys, walk, None, 0, jnp.int32(tile_first)))
        assert first_key == 0 and steps <= walk.most_steps(keys)
        walked = steps * step - short * step // 2  # a last step of half the keys where short
        assert tile_rows.sum() == tile_rows[:, :walked].sum()
        seen_keys = tile_rows.any(axis=0).nonzero()[0].max(initial=-1) + 1
        assert short == (steps > 0 and seen_keys <= whole * step + step // 2), tile_first
        for first_row in range(tile_first, min(tile_first + 2 * rows, seq_len), rows):
            lower, upper = (int(x) for x in keys.unmasked(None, 0, jnp.int32(first_row), None, 0, whole, step))
            assert lower == 0 and upper <= whole
            assert sees[first_row : first_row + rows, : upper * step].all()


def test_hopper_compression_takes_batch_rows_of_one_sequence_of_whole_tiles_of_eight(monkeypatch):
    module = compression_module(64, 64)
    monkeypatch.setattr(triton_glue, "on_hopper", lambda: True)

    def applies(seq_len, rows=None, head_dim=64, dtype=jnp.bfloat16):
        spec = module.Compression(64, 64, 2, 2, head_dim, 0, seq_len)
        q = jax.ShapeDtypeStruct((rows or seq_len, 4, head_dim), dtype)
        return module.hopper_compression_applies(spec, q, jax.ShapeDtypeStruct((seq_len // 64 + 1, 2, head_dim), dtype))

    assert applies(1024) and applies(328, head_dim=128, dtype=jnp.float16) and applies(1024, rows=3072)
    assert not applies(0, rows=64)  # packed sequences, a shard of the queries, a cache's batch rows
    assert not applies(333) and not applies(1024, head_dim=96) and not applies(1024, dtype=jnp.float32)


@pytest.mark.parametrize("block, stride", [(64, 64), (256, 64)])
def test_hopper_compression_forward_lowers_for_cuda(block, stride):
    """Lowered for CUDA on the CPU (test_hopper_kernels_lower_for_cuda says why it does not run
    here); test_hopper_compression_forward runs it on a GPU."""
    pytest.importorskip("absl")  # Mosaic GPU's lowering logs through absl
    module = compression_module(block, stride)
    for batch, seq_len, heads_kv, group, head_dim, dtype in ((1, 1024, 2, 16, 128, jnp.bfloat16),
                                                             (3, 1000, 1, 3, 64, jnp.float16)):
        spec = module.Compression(block, stride, heads_kv, group, head_dim, 0, seq_len)
        q = jax.ShapeDtypeStruct((batch * seq_len, heads_kv * group, head_dim), dtype)
        k_cmp = jax.ShapeDtypeStruct((batch * seq_len // stride + batch, heads_kv, head_dim), dtype)
        scale = jax.ShapeDtypeStruct((1,), jnp.float32)
        forward = jax.jit(lambda q, k, v, scale: module.hopper_compression_forward(spec, q, k, v, scale))
        assert "mosaic_gpu" in lower_for_cuda(forward, q, k_cmp, k_cmp, scale).as_text()


@pytest.mark.skipif(not triton_glue.on_hopper(), reason="Mosaic GPU kernels: a Hopper GPU only")
@pytest.mark.parametrize("block, stride, batch, seq_len, heads_q, heads_kv, head_dim", [
    (64, 64, 1, 1024, 16, 1, 64),  # one key a block: NSA's l = d = l'
    (32, 16, 2, 1000, 6, 2, 128),  # overlapping keys, two batch rows of a ragged length, group 3
    (256, 64, 1, 512, 4, 4, 64),  # the first tile's rows see no key: an item of no step
])
def test_hopper_compression_forward(rng, monkeypatch, block, stride, batch, seq_len, heads_q, heads_kv, head_dim):
    """The pattern's selections, output and gradients (Triton's dk/dv reads the Hopper forward's
    output and lse) against the float64 reference, with the Hopper forward shown to have run."""
    source = (f"pattern p\nblock 64\ncausal\nbranch cmp = compress(block={block}, stride={stride}) gate g_cmp\n"
              "branch slc = topk(4, block=64, score=cmp, force=local(1)) gate g_slc\n")
    spec = NsaSpec(compress_block=block, compress_stride=stride, select_count=4, select_block=64,
                   forced=lambda qb, kb: kb == qb)
    attn = nsa_dsl.compile(source)
    module = codegen.load_module("triton", attn.plan, for_device(attn.config))
    calls = record_calls(monkeypatch, module, "hopper_compression_forward")
    check_against_reference(rng, source, spec, batch=batch, seq_len=seq_len, heads_q=heads_q, heads_kv=heads_kv,
                            head_dim=head_dim, dtype=np.float16, gates=("cmp", "slc"))
    assert calls, "the compression's forward did not run on Hopper"


# ---- the window and the compression in one Hopper forward (templates/triton/hopper_window.py.j2) --

# The module has the joined forward where a top-k scores with the compression (its lse is needed).
WINDOW_AND_COMPRESSION = ("pattern p\nblock 64\ncausal\nbranch cmp = compress(block={}, stride={}) gate g_cmp\n"
                          "branch slc = topk(2, score=cmp) gate g_slc\nbranch swa = window({}) gate g_swa\n")


def window_and_compression(block, stride, window, seq_len, heads_kv, group, head_dim, packed=False):
    """The generated module of a compression and a window, and the specs of its window launch and of
    its compression."""
    attn = nsa_dsl.compile(WINDOW_AND_COMPRESSION.format(block, stride, window))
    module = codegen.load_module("triton", attn.plan, for_device(attn.config))
    window_spec = module.Static(module.static_kernels_ranges, heads_kv, group, head_dim, packed, seq_len=seq_len)
    return module, window_spec, module.Compression(block, stride, heads_kv, group, head_dim, 0, seq_len)


def test_hopper_window_and_compression_apply_where_a_kv_groups_heads_share_rows(monkeypatch):
    monkeypatch.setattr(triton_glue, "on_hopper", lambda: True)

    def applies(window=512, seq_len=1024, heads_kv=2, group=16, head_dim=128, dtype=jnp.bfloat16, packed=False,
                compression_rows=None):
        module, window_spec, compression_spec = window_and_compression(64, 64, window, seq_len, heads_kv, group,
                                                                       head_dim, packed)
        compression_spec = compression_spec._replace(seq_len=compression_rows or seq_len)
        q = jax.ShapeDtypeStruct((seq_len, heads_kv * group, head_dim), dtype)
        k_cmp = jax.ShapeDtypeStruct((seq_len // 64, heads_kv, head_dim), dtype)
        return module.hopper_window_and_compression_applies(window_spec, compression_spec, q, k_cmp)

    assert applies() and applies(window=100, group=8, head_dim=64, dtype=jnp.float16) and applies(group=32)
    assert not applies(group=4)  # one head a row tile: the compression's walks would not share rows
    assert not applies(window=2**31 - 1)  # causal: unbounded, one head a row tile
    assert not applies(packed=True) and not applies(dtype=jnp.float32) and not applies(head_dim=96)
    assert not applies(compression_rows=2048) and not applies(seq_len=1004)


@pytest.mark.parametrize("block, stride, window", [(64, 64, 512), (32, 16, 200)])
def test_hopper_window_and_compression_forward_lowers_for_cuda(block, stride, window):
    """Lowered for CUDA on the CPU (test_hopper_kernels_lower_for_cuda says why it does not run
    here); test_hopper_window_and_compression_forward runs it on a GPU."""
    pytest.importorskip("absl")  # Mosaic GPU's lowering logs through absl
    for batch, seq_len, heads_kv, group, head_dim, dtype in ((1, 1024, 2, 16, 128, jnp.bfloat16),
                                                             (3, 1000, 1, 8, 64, jnp.float16)):
        module, window_spec, compression_spec = window_and_compression(block, stride, window, seq_len, heads_kv,
                                                                       group, head_dim)
        q = jax.ShapeDtypeStruct((batch * seq_len, heads_kv * group, head_dim), dtype)
        k = jax.ShapeDtypeStruct((batch * seq_len, heads_kv, head_dim), dtype)
        k_cmp = jax.ShapeDtypeStruct((batch * compressed_count(compression_spec), heads_kv, head_dim), dtype)
        gates = jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)
        scale = jax.ShapeDtypeStruct((1,), jnp.float32)
        forward = jax.jit(lambda *args: module.hopper_window_and_compression_forward(window_spec, compression_spec,
                                                                                       *args))
        assert "mosaic_gpu" in lower_for_cuda(forward, q, k, k, k_cmp, k_cmp, scale, gates, gates).as_text()


def attention_in_numpy(q, k, v, sees, scale):
    """Softmax attention in float64 of q [T, HQ, D] against k, v [S, HKV, D] (GQA: query head h
    reads KV head h // (HQ / HKV)), where sees [T, S] says which keys each query row sees: out
    [T, HQ, D] (zeros for a row that sees none) and the lse [T, HQ] in base 2 (-inf for it)."""
    group = q.shape[1] // k.shape[1]
    k, v = (np.repeat(x.astype(np.float64), group, axis=1) for x in (k, v))
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), k) * float(scale)
    scores = np.where(sees[None], scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(-1, keepdims=True)
    out = np.einsum("hts,shd->thd", weights / np.where(total > 0, total, 1.0), v)
    with np.errstate(divide="ignore"):
        lse = (np.log(total[..., 0]) + top[..., 0]) / np.log(2.0)
    return out, lse.T


@pytest.mark.skipif(not triton_glue.on_hopper(), reason="Mosaic GPU kernels: a Hopper GPU only")
@pytest.mark.parametrize("block, stride, window, batch, seq_len, heads_kv, group, head_dim, dtype", [
    (64, 64, 512, 1, 1024, 2, 16, 128, jnp.bfloat16),  # NSA's l = d = l' and window: 5 + up to 9 steps
    (32, 16, 200, 2, 1000, 1, 8, 64, jnp.float16),  # overlapping keys, two batch rows of a ragged length
    (256, 64, 40, 1, 1536, 1, 32, 64, jnp.bfloat16),  # rows before the first key see none; long walks
])
def test_hopper_window_and_compression_forward(rng, block, stride, window, batch, seq_len, heads_kv, group, head_dim,
                                               dtype):
    """The gated sum of the window's and the compression's attention, and the compression's lse,
    against float64 on fresh random inputs and gates."""
    module, window_spec, compression_spec = window_and_compression(block, stride, window, seq_len, heads_kv, group,
                                                                   head_dim)
    heads_q, count = heads_kv * group, compressed_count(compression_spec)
    q = (rng.standard_normal((batch * seq_len, heads_q, head_dim)) * 2).astype(dtype)
    k, v = (rng.standard_normal((batch * seq_len, heads_kv, head_dim)).astype(dtype) for _ in range(2))
    k_cmp, v_cmp = (rng.standard_normal((batch * count, heads_kv, head_dim)).astype(dtype) for _ in range(2))
    gates = rng.uniform(-1.0, 1.5, (2, batch * seq_len, heads_q)).astype(np.float32)
    scale = np.asarray([head_dim**-0.5], np.float32)
    assert module.hopper_window_and_compression_applies(window_spec, compression_spec, q, k_cmp)
    forward = jax.jit(lambda *a: module.hopper_window_and_compression_forward(window_spec, compression_spec, *a))
    out, lse = (np.asarray(x, np.float64) for x in forward(q, k, v, k_cmp, v_cmp, scale, *gates))
    t = np.arange(seq_len)[:, None]
    window_sees = (t >= np.arange(seq_len)[None]) & (t - np.arange(seq_len)[None] < window)
    compression_sees = np.arange(count)[None] * stride + block - 1 <= t
    for b in range(batch):
        rows, compressed = slice(b * seq_len, (b + 1) * seq_len), slice(b * count, (b + 1) * count)
        window_out, _ = attention_in_numpy(q[rows], k[rows], v[rows], window_sees, scale[0])
        compression_out, want_lse = attention_in_numpy(q[rows], k_cmp[compressed], v_cmp[compressed],
                                                       compression_sees, scale[0])
        want = gates[0, rows, :, None] * window_out + gates[1, rows, :, None] * compression_out
        assert_close(out[rows], want, 1e-2, f"gated sum, batch row {b}")
        np.testing.assert_array_equal(np.isinf(lse[rows]), np.isinf(want_lse))
        seen = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[rows][seen], want_lse[seen], rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(not triton_glue.on_hopper(), reason="Mosaic GPU kernels: a Hopper GPU only")
@pytest.mark.parametrize("block, stride, window, seq_len, heads_q, heads_kv, head_dim", [
    (64, 64, 512, 1024, 32, 2, 128),  # NSA's setting: l = d = l', a window of 512, groups of 16
    (32, 16, 100, 1000, 8, 1, 64),  # overlapping keys, a ragged length, a group of 8
])
def test_nsa_runs_its_window_and_compression_in_one_hopper_forward(rng, monkeypatch, block, stride, window, seq_len,
                                                                  heads_q, heads_kv, head_dim):
    """A pattern's compression and window: not differentiated, one Hopper forward's gated term
    (window_and_compression); differentiated, apart. Selections, output and gradients against the
    float64 reference."""
    source = (f"pattern p\nblock 64\ncausal\nbranch cmp = compress(block={block}, stride={stride}) gate g_cmp\n"
              "branch slc = topk(4, block=64, score=cmp, force=local(1)) gate g_slc\n"
              f"branch swa = window({window}) gate g_swa\n")
    spec = NsaSpec(compress_block=block, compress_stride=stride, select_count=4, select_block=64,
                   forced=lambda qb, kb: kb == qb, window=window)
    attn = nsa_dsl.compile(source)
    module = codegen.load_module("triton", attn.plan, for_device(attn.config))
    calls = record_calls(monkeypatch, module, "hopper_window_and_compression_forward")
    check_against_reference(rng, source, spec, batch=1, seq_len=seq_len, heads_q=heads_q, heads_kv=heads_kv,
                            head_dim=head_dim, dtype=np.float16)
    assert calls, "the window and the compression did not run in one Hopper forward"


# ---- the top-k's group mass on Hopper (templates/triton/hopper_topk.py.j2) --------------------


def group_mass_in_numpy(spec, q, k_cmp, lse, scale, tokens):
    """hopper_group_mass's result in float64, written from its docstring: per batch row, KV group,
    query row (the sequence rounded up to whole items of `tokens` rows) and compressed key, the
    row's summed mass on the key, NaN where the row does not see it."""
    cmp = spec.compression
    q, k_cmp, lse = (np.asarray(x, np.float64) for x in (q, k_cmp, lse))
    batch, rows = q.shape[0] // cmp.seq_len, -(-cmp.seq_len // tokens) * tokens
    mass = np.full((batch, rows, cmp.heads_kv, mass_width(cmp)), np.nan)
    for n in range(q.shape[0]):
        scores, seen = scores_in_numpy(spec, q, k_cmp, scale, n)
        summed = np.exp2(scores - lse[n, :, None]).reshape(cmp.heads_kv, cmp.group, seen).sum(1)
        mass[n // cmp.seq_len, n % cmp.seq_len, :, :seen] = summed
    return mass.transpose(0, 2, 1, 3).reshape(batch * cmp.heads_kv, rows, -1)


def column_maxima_in_numpy(mass, width):
    """hopper_group_mass's column maxima from its mass [..., keys] (NaN where a row does not see a
    key, as group_mass_in_numpy's; keys in whole steps of `width`): entry c of a row the largest of
    0 and its masses on the keys c + i * width."""
    seen = np.nan_to_num(np.asarray(mass, np.float64), nan=0.0)
    return seen.reshape(*seen.shape[:-1], -1, width).max(-2).clip(min=0.0)


def compressed_count(cmp):
    """A sequence's compressed keys (layout.compressed_offsets)."""
    return (cmp.seq_len - cmp.block) // cmp.stride + 1 if cmp.seq_len >= cmp.block else 0


def mass_width(cmp, step=128):
    """hopper_group_mass's keys a row: whole steps of its HOPPER_BLOCK_KV keys."""
    return -(-max(compressed_count(cmp), 1) // step) * step


def scores_in_numpy(spec, q, k_cmp, scale, row):
    """([HQ, seen] base-2 scores of query row `row` against the compressed keys it sees, seen)."""
    cmp = spec.compression
    count = compressed_count(cmp)
    batch_row, pos = divmod(row, cmp.seq_len)
    seen = (pos - cmp.block + 1) // cmp.stride + 1 if pos >= cmp.block - 1 else 0
    keys = np.asarray(k_cmp[batch_row * count : batch_row * count + seen], np.float64)
    keys = keys[:, np.arange(q.shape[1]) // cmp.group]  # [seen, HQ, D]
    scores = np.einsum("hd,khd->hk", np.asarray(q[row], np.float64), keys)
    return scores * float(np.asarray(scale).reshape(-1)[0]) * np.log2(np.e), seen


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_topk_ranks_a_given_group_mass(rng, monkeypatch, dtype):
    """Where hopper_group_mass applies (a Hopper GPU), topk_selection only ranks the mass it is
    given: here the float64 mass of its docstring, NaN on every key a row does not see (reading one
    would corrupt that row's ranking: the own block, unforced here, overlaps keys the row does not
    see yet). Two batch rows, group 4, overlapping compressed keys."""
    source = ("pattern p\nblock 16\nbranch cmp = compress(block=16, stride=8) gate g_cmp\n"
              "branch slc = topk(3, block=16, score=cmp, force=global(first=1)) gate g_slc\n")
    spec = NsaSpec(compress_block=16, compress_stride=8, select_count=3, select_block=16, forced=FORCE_FIRST[1])
    attn = nsa_dsl.compile(source)
    module = codegen.load_module("triton", attn.plan, for_device(attn.config))
    monkeypatch.setattr(module, "hopper_mass_applies", lambda spec, q, k_cmp: spec.compression.seq_len > 0)

    def given_mass(spec, q, k_cmp, lse, scale):
        cmp, tokens = spec.compression, module.hopper_mass_tokens(spec)
        rows = -(-cmp.seq_len // tokens) * tokens
        shape = (q.shape[0] // cmp.seq_len * cmp.heads_kv, rows)

        def mass_and_maxima(*args):
            mass = group_mass_in_numpy(spec, *args, tokens)
            return mass.astype(np.float32), column_maxima_in_numpy(mass, module.HOPPER_BLOCK_KV).astype(np.float32)

        return jax.pure_callback(mass_and_maxima, (jax.ShapeDtypeStruct((*shape, mass_width(cmp)), jnp.float32),
                                                   jax.ShapeDtypeStruct((*shape, module.HOPPER_BLOCK_KV), jnp.float32)),
                                 q, k_cmp, lse, scale)

    calls = record_calls(monkeypatch, module, "hopper_mass_applies")
    monkeypatch.setattr(module, "hopper_group_mass", given_mass)
    check_against_reference(rng, source, spec, batch=2, seq_len=56, heads_q=8, heads_kv=2, head_dim=32, dtype=dtype,
                            gates=("cmp", "slc"), gradients=False)
    assert calls


def test_topk_steps_fit_the_sequence_and_a_branch_forcing_nothing_reads_no_forced_table():
    """A top-k step scores no more compressed keys than a sequence has (the sorting networks of
    its candidates grow with the step), and a branch without force= skips the forced blocks' load
    and merge (FORCED_WIDTH 0) whatever width its placeholder table has."""
    module = compression_module(16, 16, TOPK)
    unforced = module.TopK(4, 16, 1, module.Compression(16, 16, 2, 2, 16), False)
    assert unforced.tiles(1)["KEYS"] == 64  # the widest step whose candidates fit TOPK_CANDIDATES
    assert unforced.fitted(4096).tiles(1)["KEYS"] == 64
    assert unforced.fitted(70).tiles(1)["KEYS"] == 16  # 5 keys: the least step (tl.dot's 16)
    assert unforced.tiles(1)["FORCED_WIDTH"] == 0
    assert unforced._replace(forces=True).tiles(3)["FORCED_WIDTH"] == 3


def ranked_in_numpy(mass, seq_len, block, count):
    """Each (token, KV head)'s selection of topk(count, block=l', force=local(1)) scored by compress(
    block=l', stride=l') from a given mass [HKV, rows, width]: its own block first, then the blocks it
    may take (up to its own) by their mass on the keys it sees (zero on the others), ties to the
    lower id; -1 unused."""
    heads_kv = mass.shape[0]
    chosen = np.full((seq_len, heads_kv, count), -1)
    for pos in range(seq_len):
        own, seen = pos // block, (pos + 1) // block
        for head in range(heads_kv):
            importance = np.where(np.arange(own + 1) < seen, mass[head, pos, :own + 1], 0.0)
            others = [j for _, j in sorted((-importance[j], j) for j in range(own))][:count - 1]
            picks = [own, *others]
            chosen[pos, head, :len(picks)] = picks
    return chosen


def mass_of_kind(rng, kind, shape, run_starts, count):
    """A given mass [rows, width] for one KV head: independent, drifting (neighbouring blocks
    alike), a best run (each row's best blocks in a run longer than its picks, starting below
    run_starts) or tied (every candidate of a tile reaches the threshold: its shortlists overflow)."""
    if kind == "independent":
        return rng.random(shape)
    if kind == "drifting":
        return np.exp(np.cumsum(rng.standard_normal(shape) * 0.5, axis=-1) - 20.0)
    if kind == "best run":
        mass = rng.random(shape) * 0.1
        run = rng.integers(0, run_starts, shape[:1])[:, None] + np.arange(count + 2)
        np.put_along_axis(mass, run, 1.0 + rng.random((shape[0], count + 2)), axis=1)
        return mass
    return rng.choice(np.array([0.25, 0.5, 1.0]), shape)


# Each KV head's mass has its own kind (a tile is one head's rows, so each ranks as if alone).
@pytest.mark.parametrize("kinds, splits", [
    (("independent", "drifting"), 1), (("best run", "tied"), 1),
    # Split top-k walks (split_walks) of 336 tokens: 21 blocks in shares of 16 and 5 (a row before block 19:
    # fewer candidates in the second than picks), merged; ties across shares go to the lower id, as
    # within one; a row's run of best blocks in one share, or across both.
    (("tied", "best run"), 2),
], ids=lambda value: "+".join(value) if isinstance(value, tuple) else str(value))
def test_topk_shortlists_rank_a_given_mass(request, rng, monkeypatch, kinds, splits):
    """topk_selection ranks a given mass (hopper_group_mass's, which CI cannot run) from each row's
    shortlist of the candidates at or above its threshold, and a tile whose shortlists overflow (tied
    masses: every candidate reaches the threshold) by its chunk networks; both against numpy, over
    walks of up to three chunks (l = d = l' = 16 and steps of 16 keys: 33 blocks, 16 a chunk), two KV
    heads, and rows before their 4th block (fewer candidates than picks). The threshold comes from
    given column maxima, as a mass kernel of 32-key steps would write them (two 16-key halves). With
    splits > 1 each tile's walk splits into shares (split_walks), each ranked against the whole row's
    threshold, and topk_merge merges their keys: the ids must match exactly, ties included."""
    config = nsa_dsl.NativeSparseAttentionConfig(block_k=16)
    attn = nsa_dsl.compile(COMPRESSION_ONLY.format(64, 64) + TOPK, config=config)
    module = codegen.load_module("triton", attn.plan, for_device(attn.config))
    seq_len, heads_kv, group, head_dim, block, count = 520 if splits == 1 else 336, 2, 2, 16, 16, 4
    spec = module.TopK(count, block, 1, module.Compression(block, block, heads_kv, group, head_dim, 0, seq_len), True)
    tokens = module.hopper_mass_tokens(spec)
    shape = (heads_kv, -(-seq_len // tokens) * tokens, mass_width(spec.compression))
    mass = np.stack([mass_of_kind(rng, kind, shape[1:], 40 if splits == 1 else 20, count)
                     for kind in kinds]).astype(np.float32)
    seen = np.arange(shape[2]) < ((np.arange(shape[1]) + 1) // block)[:, None]  # [rows, keys]
    chunk = spec.tiles(1, ranking_only=True)["CHUNK"]  # the maxima's columns: two chunks a step
    maxima = column_maxima_in_numpy(np.where(seen, mass, np.nan), 2 * chunk).astype(np.float32)
    monkeypatch.setattr(module, "hopper_mass_applies", lambda spec, q, k_cmp: True)
    monkeypatch.setattr(module, "hopper_group_mass",
                        lambda spec, q, k_cmp, lse, scale: (jnp.asarray(mass), jnp.asarray(maxima)))
    launch, columns_given = triton_glue.launch, []

    def recording_launch(kernel, *args, **constants):
        columns_given.append(constants.get("COLUMNS_GIVEN"))
        return launch(kernel, *args, **constants)

    monkeypatch.setattr(triton_glue, "launch", recording_launch)
    if splits > 1:
        taken = request.getfixturevalue("split_walks")(module, splits, "topk_blocks")

    blocks = -(-seq_len // block)
    keys_cmp = compressed_count(spec.compression)
    q = jnp.asarray(normal(rng, seq_len, heads_kv * group, head_dim))
    pooled = layout.Compressed(jnp.asarray(normal(rng, keys_cmp, heads_kv, head_dim)),
                               jnp.asarray(normal(rng, keys_cmp, heads_kv, head_dim)),
                               jnp.asarray([0, keys_cmp], jnp.int32))
    lse = jnp.asarray(normal(rng, seq_len, heads_kv * group))
    own_block = (np.arange(blocks, dtype=np.int32)[:, None], np.ones(blocks, np.int32))
    chosen = module.topk_blocks(spec, q, pooled, lse, jnp.asarray([head_dim**-0.5], jnp.float32),
                                jnp.asarray([0, seq_len], jnp.int32), own_block, seq_len, seq_len,
                                layout.QueryRows.shard(0, seq_len, 1))

    assert columns_given == [True] + [None] * (splits > 1), "the ranking did not take the given maxima"
    if splits > 1:
        assert taken == [splits], f"the top-k took {taken} splits"
    want = ranked_in_numpy(mass, seq_len, block, count)
    got = np.asarray(chosen)
    bad = [tuple(row) for row in np.argwhere((got != want).any(-1))]
    assert not bad, f"{len(bad)} rows differ; (token, head) {bad[0]}: {got[bad[0]]}, want {want[bad[0]]}"


def test_hopper_group_mass_applies_where_its_mass_fits(monkeypatch):
    """The mass grows with the square of the sequence: past HOPPER_MASS_SHARE of the device's memory
    (here a device of 1 GiB) the top-k scores in Triton; so do groups of other sizes than 8 and 16."""
    module = compression_module(64, 64, TOPK)
    monkeypatch.setattr(triton_glue, "on_hopper", lambda: True)
    monkeypatch.setattr(triton_glue, "_device_memory_bytes", lambda: 1 << 30)

    def applies(seq_len, group=16, heads_kv=4):
        spec = module.TopK(16, 64, 1, module.Compression(64, 64, heads_kv, group, 128, 0, seq_len), True)
        q = jax.ShapeDtypeStruct((seq_len, heads_kv * group, 128), jnp.bfloat16)
        k_cmp = jax.ShapeDtypeStruct((seq_len // 64, heads_kv, 128), jnp.bfloat16)
        return module.hopper_mass_applies(spec, q, k_cmp)

    # 4 KV heads: 16k tokens' mass is 64 MiB (1/16 of the device: 64 MiB), 32k tokens' 256 MiB
    assert applies(16384) and not applies(32768) and applies(32768, heads_kv=1)
    assert applies(4096, group=8) and not applies(4096, group=4) and not applies(4096, group=32)


def test_hopper_group_mass_lowers_for_cuda():
    """Lowered for CUDA on the CPU (a Hopper GPU runs it: test_hopper_group_mass)."""
    pytest.importorskip("absl")  # Mosaic GPU's lowering logs through absl
    module = compression_module(64, 64, TOPK)
    for batch, seq_len, heads_kv, group, head_dim, dtype, block, stride in (
            (1, 1024, 4, 16, 128, jnp.bfloat16, 64, 64), (2, 1000, 2, 8, 64, jnp.float16, 32, 16),
            (1, 200, 3, 16, 64, jnp.bfloat16, 64, 64)):
        spec = module.TopK(16, 64, 1, module.Compression(block, stride, heads_kv, group, head_dim, 0, seq_len), True)
        q = jax.ShapeDtypeStruct((batch * seq_len, heads_kv * group, head_dim), dtype)
        k_cmp = jax.ShapeDtypeStruct((batch * compressed_count(spec.compression), heads_kv, head_dim), dtype)
        lse = jax.ShapeDtypeStruct((batch * seq_len, heads_kv * group), jnp.float32)
        scale = jax.ShapeDtypeStruct((1,), jnp.float32)
        mass = jax.jit(lambda q, k, lse, scale: module.hopper_group_mass(spec, q, k, lse, scale))
        assert "mosaic_gpu" in lower_for_cuda(mass, q, k_cmp, lse, scale).as_text()


def check_hopper_group_mass(rng, block, stride, batch, seq_len, heads_kv, group, head_dim, dtype):
    """hopper_group_mass against the float64 mass of its docstring, on every key each row sees (the
    lse: the reference's compression attention's, so each row's masses sum to 1 per head)."""
    module = compression_module(block, stride, TOPK)
    spec = module.TopK(16, 64, 1, module.Compression(block, stride, heads_kv, group, head_dim, 0, seq_len), True)
    heads_q = heads_kv * group
    q = (rng.standard_normal((batch * seq_len, heads_q, head_dim)) * 2).astype(dtype)
    k_cmp = rng.standard_normal((batch * compressed_count(spec.compression), heads_kv, head_dim)).astype(dtype)
    scale = np.asarray([head_dim**-0.5], np.float32)
    lse = np.full((batch * seq_len, heads_q), -np.inf)  # a row that sees no key: -inf
    for n in range(batch * seq_len):
        scores, seen = scores_in_numpy(spec, q, k_cmp, scale, n)
        if seen:
            lse[n] = np.log2(np.exp2(scores - scores.max(1, keepdims=True)).sum(1)) + scores.max(1)
    want = group_mass_in_numpy(spec, q, k_cmp, lse, scale, module.hopper_mass_tokens(spec))
    got, maxima = (np.asarray(x) for x in jax.jit(lambda *a: module.hopper_group_mass(spec, *a))(
        q, k_cmp, lse.astype(np.float32), scale))
    seen = ~np.isnan(want)
    assert got.shape == want.shape
    np.testing.assert_allclose(got[seen], want[seen], rtol=2e-3, atol=1e-6)
    rows = slice(0, seq_len)  # (an item's rows past the sequence are never read)
    np.testing.assert_allclose(maxima[:, rows], column_maxima_in_numpy(want[:, rows], module.HOPPER_BLOCK_KV),
                               rtol=2e-3, atol=1e-6)


@pytest.mark.skipif(not triton_glue.on_hopper(), reason="Mosaic GPU kernels: a Hopper GPU only")
@pytest.mark.parametrize("block, stride, batch, seq_len, heads_kv, group, head_dim, dtype", [
    (64, 64, 1, 4096, 2, 16, 128, jnp.bfloat16),  # NSA's l = d = l': a last tile of one token's keys
    (32, 16, 2, 1000, 1, 8, 64, jnp.float16),  # overlapping keys, two batch rows of a ragged length
    (64, 64, 1, 200, 3, 16, 64, jnp.bfloat16),  # rows before the first key see none; items of no step
])
def test_hopper_group_mass(rng, block, stride, batch, seq_len, heads_kv, group, head_dim, dtype):
    check_hopper_group_mass(rng, block, stride, batch, seq_len, heads_kv, group, head_dim, dtype)


@pytest.mark.parametrize("block, stride, batch, seq_len, heads_kv, group, head_dim, dtype", [
    (64, 64, 1, 512, 1, 16, 64, jnp.bfloat16),  # 8 items of no step first (their proxy fence)
    (32, 16, 2, 200, 1, 8, 64, jnp.float16),  # overlapping keys, two batch rows
    (16, 16, 1, 2100, 1, 8, 64, jnp.float16),  # 131 keys: walks of two steps (the column maxima's)
])
def test_hopper_group_mass_interpreted(rng, mosaic_gpu_interpreter, block, stride, batch, seq_len, heads_kv, group,
                                       head_dim, dtype):
    """The same on the CPU, in Mosaic GPU's interpreter: its warpgroups' barriers, TMA copies and
    shared memory without races (two CTAs, so that each walks several items through the ring)."""
    with mosaic_gpu_interpreter():
        check_hopper_group_mass(rng, block, stride, batch, seq_len, heads_kv, group, head_dim, dtype)
