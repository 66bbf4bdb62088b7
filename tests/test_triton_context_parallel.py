"""Context parallelism on the Triton platform: a shard of the queries (rows [offset, offset + Tq)
of the keys' sequence axis) against every key, through `nsa_dsl.runtime.attend(...,
query_offset=)` and `selections(..., query_offset=)` in one process (no mesh), the kernels run in
Triton's interpreter on the CPU, against the float64 references (tests/reference.py,
tests/nsa_reference.py) on fresh random inputs. Shards start and end at any row, on block edges
or not; some hold a single query, as a decoding step against a key/value cache does.

For every shard: its output rows are the reference's rows. Gradients: one middle shard's (dq of
its rows, dk and dv over every key, its rows' gates, the softmax scale) are the reference's for
a cotangent nonzero on its rows only; and over all shards, each with the cotangent of its own
rows, the summed dk/dv (and scale) and the shards' dq/gate rows put together are the reference's
full gradients -- what context parallelism relies on (its all-gather of K/V transposes into a
sum of the shards' dK/dV).

- static range-form branches (window | global prefix | stride progression, and a local range,
  fused in one launch), packed sequences straddling shards, rows past the last sequence: offsets
  traced under jit, one program for every shard, query tiles larger than a shard;
- static table-form branches (random draws, set algebra), bidirectional, packed, float16, GQA
  group 3, head dim 20, uneven shards, Python int offsets, small tiles (several a shard);
- explicit selection (block_indices / block_counts), two batch rows, GQA group 4, head dim 24,
  a traced softmax scale;
- full NSA (compression, top-k with forced blocks, sliding window) on packed sequences, one too
  short to compress: each shard's selections score like the reference's best;
- top-k `per block(8)` on packed sequences, groups straddling shards, scored from every query
  (scoring_query);
- shards of several batch rows (a shift from query rows to key rows per batch row): full NSA and
  table branches, each kernel launched once for all rows.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import reference
from conftest import (
    FORWARD_TOLERANCE,
    GRADIENT_TOLERANCE,
    assert_close,
    gate,
    launched_triton_kernels,
    normal,
    qkv,
    random_indices,
    triton_launches,
)
from nsa_reference import NsaSpec, chosen_scores, nsa_gradients, nsa_reference

import nsa_dsl
from nsa_dsl.config import NativeSparseAttentionConfig
from nsa_dsl.dsl import model
from nsa_dsl.plan import plan as p
from nsa_dsl.plan.ranges import static_launches
from nsa_dsl.runtime import attend, needs_scoring_query, selections

PLATFORM = "triton"
BLOCK = 16
FLOAT16_TOLERANCE = 5e-3  # float16 inputs: q.k, p and ds rounded to float16 in the kernels
# Tiles of one block: several query tiles a shard, several key steps a tile.
SMALL_TILES = NativeSparseAttentionConfig(block_size=BLOCK, block_q=BLOCK, block_k=BLOCK)


def shards(*bounds: int) -> list[slice]:
    """The row slices of shards whose boundaries are `bounds` (any rows: a shard of one row is a
    decoding step's query against the cache)."""
    return [slice(first, end) for first, end in itertools.pairwise(bounds)]


def check_every_shard(rng, attention, q, k, v, gates: dict, rows: list[slice], expected, gradients, *,
                      row_options=None, scale=None, traced=True, tolerances=(FORWARD_TOLERANCE, GRADIENT_TOLERANCE)):
    """Run `attention(q_rows, k, v, gate_rows, scale, offset, **options_rows)` (output rows) on
    every shard `rows` and compare with the float64 reference: `expected` its full output,
    `gradients(d_out)` its cotangents {"q", "k", "v", gate name..., and "scale" when `scale` is
    given} for a full-length output cotangent. `row_options`: per-query-row arrays [B, T, ...]
    passed cut to the shard's rows. `traced`: one jitted program with the offset an int32
    argument (programs traced once per shard size); else eager calls with Python int offsets.
    The middle shard's gradients are checked for a cotangent on its rows only, and the shards'
    gradients put together (dq and gate rows placed, dk/dv/scale summed) for a full one.
    Returns the shards' outputs put together."""
    forward_tolerance, gradient_tolerance = tolerances
    row_options = row_options or {}
    names = sorted(gates)
    traces = []

    def shard_vjp(q_rows, k, v, gate_rows, scale, d_rows, offset, options_rows):
        traces.append(q_rows.shape)

        def shard(q_rows, k, v, gate_rows, scale):
            return attention(q_rows, k, v, dict(zip(names, gate_rows)), scale, offset, **options_rows)

        out, pullback = jax.vjp(shard, q_rows, k, v, gate_rows, scale)
        return out, pullback(d_rows)

    run = jax.jit(shard_vjp) if traced else shard_vjp
    d_out = normal(rng, *q.shape).astype(q.dtype)
    output = np.zeros(q.shape, np.float64)
    summed = ("k", "v") if scale is None else ("k", "v", "scale")  # over every key / the whole call
    total = {"q": np.zeros(q.shape), **{n: np.zeros(gates[n].shape) for n in names}, **{n: 0.0 for n in summed}}
    middle = rows[len(rows) // 2]
    for shard in rows:
        offset = jnp.int32(shard.start) if traced else shard.start
        out, (dq, dk, dv, dgates, dscale) = run(
            q[:, shard], k, v, [gates[n][:, shard] for n in names], scale, d_out[:, shard], offset,
            {name: value[:, shard] for name, value in row_options.items()},
        )
        assert out.shape == q[:, shard].shape and out.dtype == q.dtype, (out.shape, out.dtype)
        assert_close(out, expected[:, shard], forward_tolerance, f"output rows {shard.start}:{shard.stop}")
        output[:, shard] = out
        grads = {"q": dq, "k": dk, "v": dv, "scale": dscale, **dict(zip(names, dgates))}
        grads = {name: grads[name] for name in total}
        if shard == middle:
            only_these_rows = np.zeros_like(d_out)
            only_these_rows[:, shard] = d_out[:, shard]
            wanted = gradients(only_these_rows)
            for name, actual in grads.items():
                want = wanted[name] if name in summed else wanted[name][:, shard]
                assert_close(actual, want, gradient_tolerance, f"rows {shard.start}:{shard.stop} alone: d{name}")
        for name, actual in grads.items():
            if name in summed:
                total[name] = total[name] + np.asarray(actual, np.float64)
            else:
                total[name][:, shard] = actual
    if traced:
        assert len(traces) == len({shard.stop - shard.start for shard in rows}), "the offset must not be static"
    wanted = gradients(d_out)
    for name, actual in total.items():
        assert_close(actual, wanted[name], gradient_tolerance, f"every shard: d{name}")
    return output


def mask_gradients(q, k, v, masks, branch_gates, names, scale):
    """gradients(d_out) for check_every_shard from tests/reference.py's dense masked attention:
    the cotangents of q, k, v, the gates (named `names`, in branch_gates' order) and, by central
    differences of the float64 forward, of the softmax scale."""

    def gradients(d_out):
        def loss(scale):
            return np.sum(reference.forward(q, k, v, masks, branch_gates, scale) * d_out)

        wanted = reference.gradients(q, k, v, masks, branch_gates, scale, d_out)
        step = 1e-4
        return {"q": wanted["q"], "k": wanted["k"], "v": wanted["v"], **dict(zip(names, wanted["gates"])),
                "scale": (loss(scale + step) - loss(scale - step)) / (2 * step)}

    return gradients


def static_reference(plan: p.Plan, q, k, v, gates: dict, cu_seqlens=None):
    """(expected output, gradients) of a plan of gated static branches, every gate passed."""
    batch, seq_len, _, head_dim = q.shape
    branches = [b for b in plan.branches if isinstance(b, p.StaticBranch)]
    masks = [reference.static_mask(b.static, plan.block_size, plan.causal, batch, seq_len, cu_seqlens) for b in branches]
    branch_gates = [gates[b.gate.name] for b in branches]
    scale = 1 / np.sqrt(head_dim)
    expected = reference.forward(q, k, v, masks, branch_gates, scale)
    return expected, mask_gradients(q, k, v, masks, branch_gates, [b.gate.name for b in branches], scale)


def static_attention(plan: p.Plan, cu_seqlens=None, config=None, platform=PLATFORM):
    def attention(q_rows, k, v, gate_rows, scale, offset):
        return attend(plan, q_rows, k, v, gates=gate_rows, cu_seqlens=cu_seqlens, softmax_scale=scale,
                      query_offset=offset, platform=platform, config=config)

    return attention


def assert_scores_like_the_reference(chosen, ref_chosen, scores, what: str) -> None:
    """The kernel's selected blocks score like the reference's best (exact ties may swap ids)."""
    assert ((chosen >= 0).sum(-1) == (ref_chosen >= 0).sum(-1)).all(), f"{what}: number of selected blocks"
    got, want = chosen_scores(scores, chosen), chosen_scores(scores, ref_chosen)
    finite = np.isfinite(want)
    assert (np.isfinite(got) == finite).all(), f"{what}: a selected block the reference deems invalid"
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-6, err_msg=what)


def check_nsa_shards(rng, source: str, spec: NsaSpec, q, k, v, gates: dict, cu_seqlens, rows: list[slice], config=None,
                     platform=PLATFORM):
    """Each shard's top-k selections (from a jitted `selections` with a traced offset) against
    the paper reference's scores; then outputs and gradients of every shard against the
    reference for the shards' selections (check_every_shard)."""
    plan = nsa_dsl.compile(source).plan
    scoring = {"scoring_query": q} if needs_scoring_query(plan, cu_seqlens) else {}
    (topk,) = (b.name for b in plan.branches if isinstance(b, p.TopKBranch))
    references = {name[2:]: value for name, value in gates.items()}  # g_cmp -> cmp

    choose = jax.jit(lambda q_rows, offset: selections(plan, q_rows, k, v, cu_seqlens=cu_seqlens, query_offset=offset,
                                                      platform=platform, config=config, **scoring)[topk])
    _, _, ref_chosen, scores = nsa_reference(q, k, v, spec, gates=references, cu_seqlens=cu_seqlens)
    chosen = np.empty_like(ref_chosen)
    for shard in rows:
        chosen[:, shard] = choose(q[:, shard], jnp.int32(shard.start))
        assert_scores_like_the_reference(chosen[:, shard], ref_chosen[:, shard], scores[:, shard], f"rows {shard.start}:{shard.stop}")

    expected, _, _, _ = nsa_reference(q, k, v, spec, gates=references, cu_seqlens=cu_seqlens, selected=chosen)

    def gradients(d_out):
        wanted = nsa_gradients(q, k, v, spec, references, chosen, d_out, cu_seqlens=cu_seqlens)
        return {"q": wanted["q"], "k": wanted["k"], "v": wanted["v"], **{name: wanted[name] for name in gates}}

    def attention(q_rows, k, v, gate_rows, scale, offset):
        return attend(plan, q_rows, k, v, gates=gate_rows, cu_seqlens=cu_seqlens, query_offset=offset,
                      platform=platform, config=config, **scoring)

    return check_every_shard(rng, attention, q, k, v, gates, rows, expected, gradients)


# ---- static branches ---------------------------------------------------------------------------


def test_range_branches_on_packed_sequences_straddling_shards(rng):
    """Two gated range branches (one launch); sequences start and end inside the shards, one is
    empty, rows 119.. are in none; shards on and off block edges, single rows among them (the
    last row too); the default tiles (query tiles longer than a shard); one jitted program for
    every shard size."""
    plan = nsa_dsl.compile(
        f"pattern ranged\nblock {BLOCK}\ncausal\ngate g_loc\n"
        "branch swa = window(20) | global(first=1) | stride(every=3, offset=1) gate g_swa\n"
        "branch loc = local(2) gate g_loc\n"
    ).plan
    assert [(launch.fused, launch.ranges is not None) for launch in static_launches(plan)] == [(True, True)]
    seq_len, heads_q, heads_kv, head_dim = 128, 2, 1, 16
    cu = np.array([0, 21, 50, 50, 87, 119], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, 1, seq_len, heads_q) for name in ("g_swa", "g_loc")}
    expected, gradients = static_reference(plan, q, k, v, gates, cu)
    output = check_every_shard(rng, static_attention(plan, cu), q, k, v, gates, shards(0, 32, 50, 51, 96, 127, 128),
                               expected, gradients)
    assert not output[:, 119:].any(), "rows in no sequence attend to nothing: zeros"


def test_decoding_steps_split_the_range_walks(rng, monkeypatch):
    """A decoding step's query (shards of one row, and of three) walks its keys in shares, a program
    each, merged as one walk would have (the launch has a few programs): a window with a global
    prefix and a stride progression in one branch, on packed sequences, and `causal`, whose
    walk is the whole sequence; outputs and gradients against the reference."""
    for source in (
        f"pattern ranged\nblock {BLOCK}\ncausal\n"
        "branch swa = window(20) | global(first=1) | stride(every=3, offset=1) gate g_swa\n",
        f"pattern dense\nblock {BLOCK}\ncausal\nbranch all = local(2147483647) gate g_swa\n",
    ):
        plan = nsa_dsl.compile(source).plan
        seq_len, heads_q, heads_kv, head_dim = 64, 4, 2, 16
        cu = np.array([0, 21, 64], np.int32) if "ranged" in source else None
        q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
        gates = {"g_swa": gate(rng, 1, seq_len, heads_q)}
        expected, gradients = static_reference(plan, q, k, v, gates, cu)
        launches = triton_launches(monkeypatch, lambda: check_every_shard(
            rng, static_attention(plan, cu, SMALL_TILES), q, k, v, gates, shards(0, 36, 37, 60, 63, 64), expected,
            gradients))
        splits = {grid[2] for name, grid in launches if name.startswith("static_forward")}
        assert max(splits) > 1, (source, launches)


def test_table_branches_bidirectional_float16_uneven_shards(rng):
    """Branches Triton walks from block tables (random draws; a union minus explicit blocks; an
    intersection) beside a range branch, bidirectional so that a shard's queries see keys of
    later shards; packed sequences; GQA group 3, head dim 20; shards of 16, 32 and 16 rows at
    Python int offsets; tiles of one block."""
    plan = nsa_dsl.compile(
        f"pattern tabled\nblock {BLOCK}\nbidirectional\ngate g_near\ngate g_far\ngate g_wide\n"
        "branch near = (local(2, 1) | global(first=1) | random(2, seed=5)) - blocks(3) gate g_near\n"
        "branch far = stride(2) & window(40, 24) gate g_far\n"
        "branch wide = window(12, 20) | global(first=1) gate g_wide\n"
    ).plan
    assert [(launch.name, launch.ranges is None) for launch in static_launches(plan)] == [
        ("ranges", False), ("table_near", True), ("table_far", True)]
    seq_len, heads_q, heads_kv, head_dim = 64, 3, 1, 20
    cu = np.array([0, 9, 37, 60], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim, dtype=np.float16)
    gates = {name: gate(rng, 1, seq_len, heads_q).astype(np.float16) for name in ("g_near", "g_far", "g_wide")}
    expected, gradients = static_reference(plan, q, k, v, gates, cu)
    check_every_shard(rng, static_attention(plan, cu, SMALL_TILES), q, k, v, gates, shards(0, 16, 48, 64),
                      expected, gradients, traced=False, tolerances=(FLOAT16_TOLERANCE, FLOAT16_TOLERANCE))


# ---- explicit selection ------------------------------------------------------------------------


SELECTION = p.Plan(name="selection", block_size=BLOCK, causal=True, params=(),
                   branches=(p.SelectBranch(name="slc", gate=model.Gate("g_slc", 1.0), block=BLOCK),))


def test_explicit_selection_two_batch_rows_traced_scale(rng):
    """block_indices (some negative, past the token, repeated) and block_counts per token, cut to
    each shard's rows like the queries; the softmax scale a traced argument, its gradient too."""
    check_explicit_selection(rng, shards(0, 16, 29, 30, 64))


def test_explicit_selection_key_block_by_key_block_on_shards(rng, monkeypatch, block_outer_forward):
    """The forward key block by key block (selection_forward_by_block) on shards of the queries:
    a pair's query row is not its key row there, and causality goes by the key row."""
    launches = triton_launches(monkeypatch, lambda: check_explicit_selection(rng, shards(0, 23, 24, 64)))
    assert "selection_forward_by_block" in {name for name, _ in launches}, launches


def check_explicit_selection(rng, rows: list[slice], platform=PLATFORM):
    """test_explicit_selection_two_batch_rows_traced_scale on `platform`, shards `rows`."""
    batch, seq_len, heads_q, heads_kv, head_dim, width = 2, 64, 8, 2, 24, 4
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    indices = random_indices(rng, batch, seq_len, heads_kv, width, BLOCK)
    counts = rng.integers(0, width + 1, (batch, seq_len, heads_kv)).astype(np.int32)
    gates = {"g_slc": gate(rng, batch, seq_len, heads_q)}
    scale = 0.35
    masks = [reference.selection_mask(indices, counts, BLOCK)]
    expected = reference.forward(q, k, v, masks, [gates["g_slc"]], scale)

    def attention(q_rows, k, v, gate_rows, scale, offset, block_indices, block_counts):
        return attend(SELECTION, q_rows, k, v, gates=gate_rows, softmax_scale=scale, block_indices=block_indices,
                      block_counts=block_counts, query_offset=offset, platform=platform)

    check_every_shard(rng, attention, q, k, v, gates, rows, expected,
                      mask_gradients(q, k, v, masks, [gates["g_slc"]], ["g_slc"], scale),
                      row_options={"block_indices": indices, "block_counts": counts}, scale=jnp.float32(scale))


# ---- compression and top-k ---------------------------------------------------------------------


# Compression 8/4 (overlapping, Eq. 9 weights), top-4 of 16-token blocks with the first and the two
# local blocks forced, window 24.
NSA_SOURCE = (
    f"pattern nsa\nblock {BLOCK}\ncausal\n"
    "branch cmp = compress(block=8, stride=4) gate g_cmp\n"
    "branch slc = topk(4, block=16, score=cmp, force=global(first=1) | local(2)) gate g_slc\n"
    "branch swa = window(24) gate g_swa\n"
)
NSA_SPEC = NsaSpec(compress_block=8, compress_stride=4, select_count=4, select_block=16, window=24,
                   forced=lambda qb, kb: kb < 1 or qb - 2 < kb <= qb)


def test_nsa_on_packed_sequences_straddling_shards(rng):
    """NSA_SOURCE on packed sequences; a 6-token sequence too short to compress; rows 85.. in no
    sequence; top-k over candidate chunks of one block (block_k=16)."""
    seq_len, heads_q, heads_kv, head_dim = 96, 2, 1, 12
    cu = np.array([0, 37, 43, 85], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, 1, seq_len, heads_q) for name in ("g_cmp", "g_slc", "g_swa")}
    config = NativeSparseAttentionConfig(block_size=BLOCK, block_k=BLOCK)
    output = check_nsa_shards(rng, NSA_SOURCE, NSA_SPEC, q, k, v, gates, cu, shards(0, 32, 61, 62, 96), config)
    assert not output[:, 85:].any(), "rows in no sequence attend to nothing: zeros"


def test_topk_per_block_of_queries_straddling_shards(rng):
    """Groups of 8 queries counted from each sequence's start (13, 59) straddle the shards'
    boundaries: each shard's top-k scores them from every query (scoring_query) and keeps its
    own rows' selections."""
    check_per_block_groups(rng, heads_q=2, heads_kv=1)


def check_per_block_groups(rng, heads_q: int, heads_kv: int, platform=PLATFORM):
    """test_topk_per_block_of_queries_straddling_shards with these heads, on `platform`."""
    source = (
        f"pattern per_block\nblock {BLOCK}\ncausal\n"
        "branch cmp = compress(block=16, stride=8) gate g_cmp\n"
        "branch slc = topk(2, block=16, score=cmp, force=local(1)) per block(8) gate g_slc\n"
    )
    spec = NsaSpec(compress_block=16, compress_stride=8, select_count=2, select_block=16, query_block=8,
                   forced=lambda qb, kb: kb == qb)
    seq_len, head_dim = 96, 16
    cu = np.array([0, 13, 59, 93], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, 1, seq_len, heads_q) for name in ("g_cmp", "g_slc")}
    check_nsa_shards(rng, source, spec, q, k, v, gates, cu, shards(0, 32, 64, 96), platform=platform)


# ---- several batch rows ------------------------------------------------------------------------


def launched_kernels(monkeypatch, platform: str, run) -> list[str]:
    """The kernels `run(trace)` launches while jax traces it (trace: jax.make_jaxpr's jaxpr of a
    function, as text): Triton kernels by name, or Pallas calls."""
    if platform != "triton":
        found = []
        run(lambda fn, *args: found.extend(["pallas_call"] * str(jax.make_jaxpr(fn)(*args)).count("pallas_call[")))
        return found
    return launched_triton_kernels(monkeypatch, lambda: run(lambda fn, *args: jax.make_jaxpr(fn)(*args)))


def test_nsa_shards_of_three_batch_rows_in_one_launch_per_kernel(rng, monkeypatch):
    """Full NSA on shards of 3 batch rows of 75 tokens (rows [offset, offset + Tq) of each: a
    decoding step's single row, and shards off block edges): outputs, selections and gradients
    are the paper reference's, and each kernel launches once for the three rows, as for one."""
    check_batch_row_shards(rng, monkeypatch)


def check_batch_row_shards(rng, monkeypatch, platform=PLATFORM):
    """test_nsa_shards_of_three_batch_rows_in_one_launch_per_kernel on `platform`."""
    batch, seq_len, heads_q, heads_kv, head_dim = 3, 75, 4, 2, 12
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, batch, seq_len, heads_q) for name in ("g_cmp", "g_slc", "g_swa")}
    config = NativeSparseAttentionConfig(block_size=BLOCK, block_k=BLOCK)
    check_nsa_shards(rng, NSA_SOURCE, NSA_SPEC, q, k, v, gates, None, shards(0, 30, 31, 74, 75), config,
                     platform=platform)

    plan = nsa_dsl.compile(NSA_SOURCE).plan

    def kernels(rows: int) -> list[str]:
        def run(trace):
            trace(lambda q, k, v: attend(
                plan, q[:rows, 40:41], k[:rows], v[:rows], gates={"g_cmp": gates["g_cmp"][:rows, 40:41]},
                query_offset=40, platform=platform, config=config), q, k, v)
        return launched_kernels(monkeypatch, platform, run)

    one = kernels(1)
    assert one and kernels(batch) == one, "a batch's shard must launch each kernel once, as one row does"


def test_table_branches_on_shards_of_two_batch_rows(rng):
    """Table-form and range branches, bidirectional (a shard's queries see later keys), on
    shards of 2 batch rows: each batch row's query tiles and its dk/dv walks over its own
    query rows."""
    check_batch_row_tables(rng)


def check_batch_row_tables(rng, platform=PLATFORM):
    """test_table_branches_on_shards_of_two_batch_rows on `platform`."""
    plan = nsa_dsl.compile(
        f"pattern tabled\nblock {BLOCK}\nbidirectional\ngate g_near\ngate g_wide\n"
        "branch near = (local(2, 1) | global(first=1) | random(2, seed=5)) - blocks(3) gate g_near\n"
        "branch wide = window(12, 20) | global(first=1) gate g_wide\n"
    ).plan
    batch, seq_len, heads_q, heads_kv, head_dim = 2, 56, 2, 1, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, batch, seq_len, heads_q) for name in ("g_near", "g_wide")}
    expected, gradients = static_reference(plan, q, k, v, gates)
    check_every_shard(rng, static_attention(plan, config=SMALL_TILES, platform=platform), q, k, v, gates,
                      shards(0, 19, 20, 56), expected, gradients)
