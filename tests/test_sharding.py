"""Sparse attention over a device mesh (nsa_dsl.sharding) and the kernels' query_offset.

jax fixes the number of host devices when it starts, so test_on_eight_host_devices runs this
file again in a fresh process on the CPU with XLA_FLAGS=--xla_force_host_platform_device_count=8
(and XLA:CPU's cheaper compilation: the programs are small, compiling them dominates); every
other test runs there and is skipped here. benchmarks/bench_sharded.py checks real GPUs.

- Every sharding (data, head, context, data x context, head x context) gives the single-device
  output and gradients of q, k, v and the gates, in float32, on fresh random inputs: the full NSA
  pattern (examples/nsa.nsa scaled down), packed sequences straddling shard boundaries, explicit
  block_indices, a user's own shard_map around `per_shard`, top-k selections.
- query_offset (a shard of the queries against all keys) in the XLA module: a shard's rows of
  the float64 references' full result, and their gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from conftest import FORWARD_TOLERANCE, GRADIENT_TOLERANCE, assert_close, child_env, gate, normal, qkv, random_indices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from nsa_reference import NsaSpec, nsa_gradients, nsa_reference, small_example

import nsa_dsl
from nsa_dsl.dsl import model
from nsa_dsl.plan import plan as p
from nsa_dsl.runtime import attend, selections
from nsa_dsl.sharding import ShardedAttention, sharded_native_sparse_attention

DEVICES = 8
_WORKER = "NSA_DSL_SHARDING_TEST_WORKER"
IN_WORKER = os.environ.get(_WORKER) == "1"
in_worker = pytest.mark.skipif(not IN_WORKER, reason="runs in test_on_eight_host_devices' process")

# Sharded against single-device float32: the same arithmetic, regrouped into other chunks.
SHARDED_TOLERANCE = 1e-5

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BLOCK = 16
TPU = nsa_dsl.NativeSparseAttentionConfig(block_size=BLOCK, backend="tpu")  # kernels generated for a TPU


# The worker's tests in two halves of about equal time, so that pytest-xdist's two workers share them.
HALF = "interpreted_kernels or shorter_than_a_compressed_block"


@pytest.mark.skipif(IN_WORKER, reason="the launcher itself")
@pytest.mark.parametrize("selected, skipped", [(HALF, ""), (f"not ({HALF})", ", 2 skipped")],  # these launchers
                         ids=["first half", "second half"])
def test_on_eight_host_devices(selected, skipped):
    flags = f"--xla_force_host_platform_device_count={DEVICES}"  # after conftest's compile flags
    root = str(Path(__file__).resolve().parents[1])
    # CPU host devices on any machine: a GPU host's device count must not decide which meshes exist.
    env = child_env(XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip(), JAX_PLATFORMS="cpu",
                    **{_WORKER: "1"})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selected, __file__],
                         check=False, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    report = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, report
    assert re.search(rf"\b\d+ passed{skipped}, \d+ deselected\b", run.stdout), report


# ---- patterns and inputs ---------------------------------------------------------------------


def scaled_nsa() -> tuple[nsa_dsl.SparseAttention, NsaSpec]:
    """examples/nsa.nsa with blocks of 16 (compress 8/4, top-5 of 16, window 24) and its reference spec."""
    source, spec = small_example("nsa")
    return nsa_dsl.compile(source), spec


STATIC = f"pattern static\nblock {BLOCK}\ncausal\nbranch a = window(20) | global(first=1) | stride(every=3, offset=1) gate g_swa\n"
SELECTION = p.Plan(name="selection", block_size=BLOCK, causal=True, params=(),
                   branches=(p.SelectBranch(name="slc", gate=model.Gate("g_slc", 1.0), block=BLOCK),))


def one_device(plan: p.Plan, platform: str | None = None):
    """The plan's attention without a mesh, called like a ShardedAttention."""

    def call(query, key, value, *, cu_seqlens=None, softmax_scale=None, block_indices=None, block_counts=None, **gates):
        return attend(plan, query, key, value, gates=gates, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale,
                      block_indices=block_indices, block_counts=block_counts, platform=platform)

    return call


def mesh(**axes: int) -> jax.sharding.Mesh:
    """A mesh of the first prod(sizes) devices with the given axes (Auto axis types)."""
    size = int(np.prod(list(axes.values())))
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                         devices=jax.devices()[:size])


def nsa_gates(rng, batch, seq_len, heads_q) -> dict[str, np.ndarray]:
    return {name: gate(rng, batch, seq_len, heads_q) for name in ("g_cmp", "g_slc", "g_swa")}


def forward_and_gradients(attention, q, k, v, gates: dict, d_out, **options):
    """attention(q, k, v, **gates, **options) and the gradients of <output, d_out> with respect
    to q, k, v and each gate, in one jitted program."""
    names = sorted(gates)

    @jax.jit
    def run(q, k, v, given, d_out):
        out, pullback = jax.vjp(lambda q, k, v, given: attention(q, k, v, **dict(zip(names, given)), **options),
                                q, k, v, given)
        return out, pullback(d_out)

    out, (dq, dk, dv, dgates) = run(q, k, v, [gates[n] for n in names], d_out)
    return {"output": out, "dq": dq, "dk": dk, "dv": dv, **{f"d{n}": g for n, g in zip(names, dgates)}}


def assert_same(sharded: dict, single: dict, what: str) -> None:
    for name, expected in single.items():
        assert sharded[name].shape == expected.shape, (what, name)
        assert_close(sharded[name], expected, SHARDED_TOLERANCE, f"{what}: {name}")


# ---- shardings against one device ----------------------------------------------------------


@in_worker
def test_nsa_every_sharding_with_the_sequence(rng):
    """Full NSA: context parallel over 8 shards of one block each, data x context, head x
    context (GQA groups of 2 kept whole), data parallel."""
    attention, _ = scaled_nsa()
    batch, seq_len, heads_q, heads_kv, head_dim = 2, 128, 8, 4, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    gates, d_out = nsa_gates(rng, batch, seq_len, heads_q), normal(rng, batch, seq_len, heads_q, head_dim)
    single = forward_and_gradients(attention, q, k, v, gates, d_out)
    for axes, sharding in (
        ({"sp": 8}, {"sequence_axis": "sp"}),
        ({"dp": 2, "sp": 4}, {"batch_axis": "dp", "sequence_axis": "sp"}),
        ({"tp": 2, "sp": 4}, {"head_axis": "tp", "sequence_axis": "sp"}),
        ({"dp": 2}, {"batch_axis": "dp"}),
    ):
        layer = attention.sharded(mesh(**axes), **sharding)
        result = forward_and_gradients(layer, q, k, v, gates, d_out)
        assert result["output"].sharding.is_equivalent_to(NamedSharding(layer.mesh, layer.spec), 4)
        assert_same(result, single, str(sharding))


@in_worker
def test_nsa_context_parallel_shards_off_block_edges(rng):
    """Full NSA over 8 shards of 13 rows (T = 104, blocks of 16): every shard starts and ends
    off a block edge, single-device output and gradients all the same."""
    attention, _ = scaled_nsa()
    seq_len, heads_q, heads_kv, head_dim = 104, 4, 2, 16
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    gates, d_out = nsa_gates(rng, 1, seq_len, heads_q), normal(rng, 1, seq_len, heads_q, head_dim)
    single = forward_and_gradients(attention, q, k, v, gates, d_out)
    layer = attention.sharded(mesh(sp=8), sequence_axis="sp")
    assert_same(forward_and_gradients(layer, q, k, v, gates, d_out), single, "context, 13 rows a shard")


@in_worker
def test_nsa_shorter_than_a_compressed_block(rng):
    """T = 6 keys, fewer than the compress block (8): no compressed key exists. Data, head and
    context parallel gradients equal one device's; the compression's custom_vjp (XLA's, Triton's)
    gave the keys it pooled as zeros a cotangent varying over the mesh axes, which the zeros did
    not (a ValueError from JAX while differentiating)."""
    attention, _ = scaled_nsa()
    batch, seq_len, heads_q, heads_kv, head_dim = 2, 6, 4, 2, 8
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    gates, d_out = nsa_gates(rng, batch, seq_len, heads_q), normal(rng, batch, seq_len, heads_q, head_dim)
    single = forward_and_gradients(attention, q, k, v, gates, d_out)
    for axes, sharding in (({"dp": 2}, {"batch_axis": "dp"}), ({"tp": 2}, {"head_axis": "tp"}),
                           ({"sp": 2}, {"sequence_axis": "sp"}), ({"sp": 3}, {"sequence_axis": "sp"})):
        layer = attention.sharded(mesh(**axes), **sharding)
        assert_same(forward_and_gradients(layer, q, k, v, gates, d_out), single, str(sharding))
    on_triton = forward_and_gradients(attention, q, k, v, gates, d_out, platform="triton")
    layer = attention.sharded(mesh(dp=2), batch_axis="dp")
    assert_same(forward_and_gradients(layer, q, k, v, gates, d_out, platform="triton"), on_triton, "triton, dp")


@in_worker
def test_nsa_context_parallel_packed_sequences_straddle_shards(rng):
    """cu_seqlens [B == 1] whose sequences start and end inside shards of 16 rows; rows past the
    last sequence belong to none."""
    attention, _ = scaled_nsa()
    seq_len, heads_q, heads_kv, head_dim = 128, 6, 2, 24
    cu = np.array([0, 21, 50, 50, 97, 120], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    gates, d_out = nsa_gates(rng, 1, seq_len, heads_q), normal(rng, 1, seq_len, heads_q, head_dim)
    single = forward_and_gradients(attention, q, k, v, gates, d_out, cu_seqlens=cu)
    layer = attention.sharded(mesh(sp=8), sequence_axis="sp")
    assert_same(forward_and_gradients(layer, q, k, v, gates, d_out, cu_seqlens=cu), single, "context, packed")
    chosen = attention.selections(q, k, v, cu_seqlens=cu)
    np.testing.assert_array_equal(layer.selections(q, k, v, cu_seqlens=cu)["slc"], chosen["slc"])


def per_block_nsa() -> nsa_dsl.SparseAttention:
    """Compression and top-2 of 16-token blocks per block(8) of queries, counted from each
    sequence's start: with packed sequences a group may straddle two shards."""
    return nsa_dsl.compile(
        f"pattern per_block\nblock {BLOCK}\ncausal\nbranch cmp = compress(block=16, stride=8) gate g_cmp\n"
        "branch slc = topk(2, block=16, score=cmp, force=local(1)) per block(8) gate g_slc\n"
    )


@in_worker
def test_context_parallel_groups_of_queries_straddling_shards(rng):
    """Sequences starting at odd rows: groups of 8 queries straddle the 16-row shards; each shard
    scores them from every query (scoring_query) and keeps its own rows' selections."""
    attention = per_block_nsa()
    seq_len, heads_q, heads_kv, head_dim = 128, 4, 2, 16
    cu = np.array([0, 13, 59, 101, 125], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, 1, seq_len, heads_q) for name in ("g_cmp", "g_slc")}
    d_out = normal(rng, 1, seq_len, heads_q, head_dim)
    single = forward_and_gradients(attention, q, k, v, gates, d_out, cu_seqlens=cu)
    layer = attention.sharded(mesh(sp=8), sequence_axis="sp")
    assert_same(forward_and_gradients(layer, q, k, v, gates, d_out, cu_seqlens=cu), single, "context, per block(8)")
    chosen = attention.selections(q, k, v, cu_seqlens=cu)["slc"]
    np.testing.assert_array_equal(layer.selections(q, k, v, cu_seqlens=cu)["slc"], chosen)
    # Without every query a shard cannot score its straddling groups: refused, not approximated.
    with pytest.raises(ValueError, match="scoring_query: topk branch 'slc'.*straddle two shards"):
        attend(attention.plan, q[:, 16:32], k, v, gates={n: g[:, 16:32] for n, g in gates.items()}, cu_seqlens=cu,
               query_offset=16)


@in_worker
def test_explicit_block_indices_heads_and_context(rng):
    """Explicit per-token selection (some entries negative, past the token or repeated) on packed
    sequences: head parallel, context parallel, head x context; a traced softmax_scale."""
    seq_len, heads_q, heads_kv, head_dim = 96, 12, 4, 20
    cu = np.array([0, 7, 40, 90], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    indices = random_indices(rng, 1, seq_len, heads_kv, 4, BLOCK, cu)
    counts = rng.integers(0, 5, (1, seq_len, heads_kv)).astype(np.int32)
    gates, d_out = {"g_slc": gate(rng, 1, seq_len, heads_q)}, normal(rng, 1, seq_len, heads_q, head_dim)
    options = {"cu_seqlens": cu, "block_indices": indices, "block_counts": counts, "softmax_scale": jnp.float32(0.3)}
    single = forward_and_gradients(one_device(SELECTION), q, k, v, gates, d_out, **options)
    for axes, sharding in (
        ({"tp": 4}, {"head_axis": "tp"}),
        ({"sp": 6}, {"sequence_axis": "sp"}),
        ({"tp": 2, "sp": 3}, {"head_axis": "tp", "sequence_axis": "sp"}),
    ):
        layer = ShardedAttention(SELECTION, mesh=mesh(**axes), **sharding)
        assert_same(forward_and_gradients(layer, q, k, v, gates, d_out, **options), single, str(sharding))


@in_worker
def test_per_shard_inside_a_users_shard_map(rng):
    """A user's own shard_map (data x context, a static pattern) around `per_shard`, with the
    PartitionSpecs the ShardedAttention names."""
    attention = nsa_dsl.compile(STATIC)
    batch, seq_len, heads_q, heads_kv, head_dim = 4, 64, 4, 2, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    gates, d_out = {"g_swa": gate(rng, batch, seq_len, heads_q)}, normal(rng, batch, seq_len, heads_q, head_dim)
    layer = attention.sharded(batch_axis="dp", sequence_axis="sp")
    user_mesh = mesh(dp=2, sp=4)

    def user_layer(q, k, v, g_swa):
        body = jax.shard_map(lambda q, k, v, g: layer.per_shard(q, k, v, g_swa=g), mesh=user_mesh,
                             in_specs=(layer.spec, layer.spec, layer.spec, layer.gate_spec), out_specs=layer.spec)
        return body(q, k, v, g_swa)

    single = forward_and_gradients(attention, q, k, v, gates, d_out)
    assert_same(forward_and_gradients(user_layer, q, k, v, gates, d_out), single, "per_shard")
    with jax.set_mesh(user_mesh):  # mesh=None: the mesh set with jax.set_mesh
        assert_close(layer(q, k, v, **gates), single["output"], SHARDED_TOLERANCE, "jax.set_mesh")


@in_worker
def test_sharding_errors(rng):
    attention, _ = scaled_nsa()
    q, k, v = qkv(rng, 2, 64, 6, 3, 8)
    gates = nsa_gates(rng, 2, 64, 6)
    with pytest.raises(ValueError, match=r"num_kv_heads 3 is not divisible by the 2 devices of head_axis 'tp'.*group"):
        attention.sharded(mesh(tp=2), head_axis="tp")(q, k, v, **gates)
    with pytest.raises(ValueError, match=r"seq_len 60 must be divisible by the 8 devices of sequence_axis 'sp'$"):
        attention.sharded(mesh(sp=8), sequence_axis="sp")(q[:, :60], k[:, :60], v[:, :60],
                                                          **{n: g[:, :60] for n, g in gates.items()})
    grouped_gates = {name: gates[name] for name in ("g_cmp", "g_slc")}
    with pytest.raises(ValueError, match=r"seq_len 64 must be divisible by the 8 devices of sequence_axis 'sp' times "
                                         r"the pattern's block \(16\): its top-k scores whole groups"):
        per_block_nsa().sharded(mesh(sp=8), sequence_axis="sp")(q, k, v, **grouped_gates)
    with pytest.raises(ValueError, match=r"batch 1 is not divisible by the 2 devices.*cu_seqlens"):
        attention.sharded(mesh(dp=2), batch_axis="dp")(q[:1], k[:1], v[:1], cu_seqlens=np.array([0, 64]),
                                                       **{n: g[:1] for n, g in gates.items()})
    with pytest.raises(ValueError, match="sequence_axis: the mesh has no axis 'cp'"):
        attention.sharded(mesh(sp=2), sequence_axis="cp")
    with pytest.raises(ValueError, match="already shards another dimension"):
        attention.sharded(mesh(sp=2), batch_axis="sp", sequence_axis="sp")
    with pytest.raises(ValueError, match="mesh: pass a jax.sharding.Mesh"):
        attention.sharded(sequence_axis="sp")(q, k, v, **gates)
    on_tpu = dataclasses.replace(attention.sharded(mesh(sp=2), sequence_axis="sp"), config=TPU)
    with pytest.raises(NotImplementedError, match="context parallelism.*pallas backend on TPU; here 'xla' supports it"):
        on_tpu(q, k, v, platform="pallas", **gates)


@in_worker
def test_decoding_arguments_are_refused_by_name(rng):
    """SparseAttention's decoding arguments (query_offset, scoring_query, compressed) are not
    ShardedAttention's: a call or per_shard given one says so and where decoding runs, rather than
    calling it an unknown gate or blaming the keys' length."""
    attention, _ = scaled_nsa()
    seq_len, heads_q, heads_kv, head_dim = 40, 4, 2, 8
    q, k, v = qkv(rng, 2, seq_len, heads_q, heads_kv, head_dim)
    gates = nsa_gates(rng, 2, seq_len, heads_q)
    step_gates = {name: g[:, 7:8] for name, g in gates.items()}
    layer = attention.sharded(mesh(tp=2), head_axis="tp")
    for name, value in (("query_offset", 7), ("scoring_query", q), ("compressed", attention.compress(k, v))):
        for call in (layer, layer.per_shard):
            for rows, given_gates in ((slice(7, 8), step_gates), (slice(None), gates)):
                with pytest.raises(ValueError, match=rf"^{name}: a ShardedAttention attends whole sequences.*shard_map"):
                    call(q[:, rows], k, v, **{name: value}, **given_gates)



def explicit_mesh(**axes: int) -> jax.sharding.Mesh:
    """mesh(**axes) with Explicit axes (jax.make_mesh's default): arrays' types carry their sharding."""
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(jax.sharding.AxisType.Explicit,) * len(axes),
                         devices=jax.devices()[:int(np.prod(list(axes.values())))])


@in_worker
def test_arrays_on_explicit_axes_run_where_they_lie(rng):
    """Plain calls of arrays sharded along Explicit mesh axes (which JAX refused inside the kernels'
    gathers: ShardingTypeError) run as a ShardedAttention along the query's batch, sequence and
    head axes: each device computes its own shard (the output and gradients keep the query's
    sharding), with the single-device output and gradients; top-k selections and ejkernel's API
    alike. Keys placed otherwise than the query are moved to it; compress and the decoding
    arguments are refused by name."""
    attention, _ = scaled_nsa()
    batch, seq_len, heads_q, heads_kv, head_dim = 2, 64, 4, 2, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    gates, d_out = nsa_gates(rng, batch, seq_len, heads_q), normal(rng, batch, seq_len, heads_q, head_dim)
    single = forward_and_gradients(attention, q, k, v, gates, d_out)
    picked = attention.selections(q, k, v)
    def native(q, k, v, g_cmp, g_slc):  # NSA as ejkernel configures it: top-3 blocks of 16 (positional arguments)
        return nsa_dsl.native_sparse_attention(q, k, v, g_cmp, g_slc, None, 3, cfg=nsa_dsl.NativeSparseAttentionConfig(block_size=BLOCK))

    native_single = native(q, k, v, gates["g_cmp"], gates["g_slc"])
    devices = explicit_mesh(dp=2, tp=2)
    for query_spec, key_spec in ((P("dp", None, "tp"), P("dp", None, "tp")), (P(None, "tp"), P("dp")),
                                 (P(), P(None, None, "tp"))):
        put = functools.partial(jax.device_put, device=NamedSharding(devices, query_spec))
        with jax.set_mesh(devices):
            q_on, d_out_on = put(q), put(d_out)
            k_on, v_on = (jax.device_put(x, NamedSharding(devices, key_spec)) for x in (k, v))
            gates_on = {n: jax.device_put(g, NamedSharding(devices, P(*query_spec[:3]))) for n, g in gates.items()}
            result = forward_and_gradients(attention, q_on, k_on, v_on, gates_on, d_out_on)
            for name in ("output", "dq"):
                assert result[name].sharding.spec == P(*query_spec, *[None] * (4 - len(query_spec))), (query_spec, name)
            assert_same(result, single, f"query {query_spec}, keys {key_spec}")
            chosen = attention.selections(q_on, k_on, v_on)
            assert all(np.array_equal(chosen[n], picked[n]) for n in picked), query_spec
            assert_close(jax.jit(native)(q_on, k_on, v_on, gates_on["g_cmp"], gates_on["g_slc"]), native_single,
                         SHARDED_TOLERANCE, f"native_sparse_attention, query {query_spec}")
            with pytest.raises(ValueError, match="^key: compress takes keys.*not sharded along Explicit mesh axes"):
                attention.compress(k_on, v_on)
            with pytest.raises(ValueError, match="^query_offset: this call's arrays are sharded along Explicit mesh axes"):
                attention(q[:, 7:8], k_on, v_on, query_offset=7, **{n: g[:, 7:8] for n, g in gates.items()})


@in_worker
@pytest.mark.parametrize("platform", ["triton", "pallas"])
def test_data_and_head_parallel_on_the_interpreted_kernels(rng, platform):
    """Data and head parallelism need no query offset: every platform runs them. Gradients too:
    the kernels' custom_vjp results carry the shards' manual axes, and the softmax scale (an
    array, replicated) gets the sum of every device's part."""
    seq_len, heads_q, heads_kv, head_dim = 32, 4, 2, 16
    q, k, v = qkv(rng, 2, seq_len, heads_q, heads_kv, head_dim)
    indices = random_indices(rng, 2, seq_len, heads_kv, 2, BLOCK)
    g_slc, d_out = gate(rng, 2, seq_len, heads_q), normal(rng, *q.shape)
    scale = jnp.float32(0.3)
    layer = ShardedAttention(SELECTION, mesh=mesh(dp=2, tp=2), batch_axis="dp", head_axis="tp")

    def loss(attention, **options):
        def inner(q, k, v, g_slc, scale):
            out = attention(q, k, v, block_indices=indices, block_counts=2, g_slc=g_slc, softmax_scale=scale, **options)
            return jnp.sum(out * d_out), out

        return jax.grad(inner, argnums=range(5), has_aux=True)(q, k, v, g_slc, scale)

    grads, out = loss(layer, platform=platform)
    expected_grads, expected = loss(one_device(SELECTION))
    assert_close(out, expected, SHARDED_TOLERANCE, platform)
    for name, actual, want in zip(("q", "k", "v", "g_slc", "softmax_scale"), grads, expected_grads):
        assert_close(actual, want, GRADIENT_TOLERANCE, f"{platform} d{name}")


@in_worker
@pytest.mark.parametrize("platform", ["triton", "pallas"])
def test_context_parallel_on_the_interpreted_kernels(rng, platform):
    """The Triton and Pallas (GPU variant) kernels take a shard of the queries: NSA with its
    sequence axis over 4 devices, packed sequences straddling the shards, gives the single-device
    output and gradients on the same platform."""
    attention, _ = scaled_nsa()
    seq_len, heads_q, heads_kv, head_dim = 64, 4, 2, 16
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    gates, d_out = nsa_gates(rng, 1, seq_len, heads_q), normal(rng, *q.shape)
    cu = np.array([0, 23, 58], np.int32)  # sequence 0 ends in shard 1 of 4, sequence 1 ends before the last row
    layer = attention.sharded(mesh(sp=4), sequence_axis="sp")
    sharded = forward_and_gradients(functools.partial(layer, platform=platform), q, k, v, gates, d_out, cu_seqlens=cu)
    single = forward_and_gradients(one_device(attention.plan, platform), q, k, v, gates, d_out, cu_seqlens=cu)
    assert_same(sharded, single, f"{platform}, sequence axis over 4 devices")


@in_worker
def test_sharded_native_sparse_attention_chooses_its_cfg_for_one_shard(rng, monkeypatch):
    """ejkernel's API over a mesh: the Kernel interface picks the configuration for one shard's
    arguments (method "shard_map"), the automatic platform is one that runs a shard of the queries."""
    from nsa_dsl.kernel import NativeSparseAttention

    invocations = []
    choose_cfg = NativeSparseAttention.choose_cfg
    monkeypatch.setattr(NativeSparseAttention, "choose_cfg",
                        lambda self, inv, requested=None: invocations.append(inv) or choose_cfg(self, inv, requested))
    q, k, v = qkv(rng, 2, 128, 4, 2, 16)
    g_cmp, g_slc = gate(rng, 2, 128, 4), gate(rng, 2, 128, 4)
    attention = sharded_native_sparse_attention(mesh(dp=2, sp=4), batch_axis="dp", sequence_axis="sp", block_size=BLOCK)
    out = attention(q, k, v, g_cmp, g_slc, None, 3)
    (invocation,) = invocations
    assert invocation.method == "shard_map" and invocation.arguments["platform"] == "xla"
    assert invocation.arguments["query"].shape == (1, 32, 4, 16) and invocation.arguments["g_slc"].shape == (1, 32, 4)
    single = nsa_dsl.native_sparse_attention(q, k, v, g_cmp, g_slc, None, 3, cfg=nsa_dsl.NativeSparseAttentionConfig(block_size=BLOCK))
    assert_close(out, single, SHARDED_TOLERANCE, "native_sparse_attention")
    # ejkernel's configuration object (its fields by name), as ejkernel's own callers pass it
    theirs = type("NativeSparseAttentionConfig", (), {"block_size": BLOCK, "platform": "xla", "backend": "any"})()
    assert_close(attention(q, k, v, g_cmp, g_slc, None, 3, cfg=theirs), single, SHARDED_TOLERANCE, "ejkernel's cfg")


# ---- query_offset in the XLA module, against the float64 references ----------------------------


def shard_rows(seq_len: int, shards: int):
    size = seq_len // shards
    return [(i * size, size) for i in range(shards)]


@in_worker
def test_query_offset_static_pattern_against_the_reference(rng):
    """Every shard's rows (packed sequences straddling shards, offsets traced) equal the
    reference's; one shard's gradients equal the reference's for a cotangent on its rows only."""
    attention = nsa_dsl.compile(STATIC)
    seq_len, heads_q, heads_kv, head_dim = 96, 4, 2, 12
    cu = np.array([0, 10, 45, 80], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    g = gate(rng, 1, seq_len, heads_q)
    masks = [reference.static_mask(attention.plan.branches[0].static, BLOCK, True, 1, seq_len, cu)]
    scale = 1 / np.sqrt(head_dim)
    expected = reference.forward(q, k, v, masks, [g], scale)

    def shard_attention(q_rows, k, v, g_rows, offset):
        return attend(attention.plan, q_rows, k, v, gates={"g_swa": g_rows}, cu_seqlens=cu, query_offset=offset)

    run = jax.jit(shard_attention)
    # Whole-block shards, then rows at any offset: single queries (decoding against a cache) at a
    # sequence's first row, mid-block, at a block's last row, on the last row; a chunk across blocks.
    for offset, size in [*shard_rows(seq_len, 3), (0, 1), (10, 1), (47, 1), (95, 1), (37, 13)]:
        rows = slice(offset, offset + size)
        assert_close(run(q[:, rows], k, v, g[:, rows], jnp.int32(offset)), expected[:, rows], FORWARD_TOLERANCE, f"rows {rows}")

    offset, size = 29, 21  # the end of sequence 0's rows and the start of sequence 2's, not on block edges
    rows = slice(offset, offset + size)
    d_out = np.zeros_like(q)
    d_out[:, rows] = normal(rng, 1, size, heads_q, head_dim)
    wanted = reference.gradients(q, k, v, masks, [g], scale, d_out)
    _, pullback = jax.vjp(lambda q_rows, k, v, g_rows: shard_attention(q_rows, k, v, g_rows, offset), q[:, rows], k, v, g[:, rows])
    dq, dk, dv, dg = pullback(jnp.asarray(d_out[:, rows]))
    for name, actual, want in (("dq", dq, wanted["q"][:, rows]), ("dk", dk, wanted["k"]), ("dv", dv, wanted["v"]),
                               ("dg_swa", dg, wanted["gates"][0][:, rows])):
        assert_close(actual, want, GRADIENT_TOLERANCE, name)


@in_worker
def test_query_offset_mid_tile_in_every_batch_row_against_the_reference(rng):
    """Three batch rows (no cu_seqlens) whose queries start mid-tile: each row's first query tile
    is cut by the offset, so a row needs one tile more than its rows fill. The XLA module's tile
    bound allowed one such tile in all, and the last batch row's output was wrong (session 59)."""
    attention = nsa_dsl.compile(STATIC)
    batch, seq_len, heads_q, heads_kv, head_dim = 3, 70, 4, 2, 12
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    g = gate(rng, batch, seq_len, heads_q)
    masks = [reference.static_mask(attention.plan.branches[0].static, BLOCK, True, batch, seq_len)]
    expected = reference.forward(q, k, v, masks, [g], 1 / np.sqrt(head_dim))
    for offset, size in [(15, 18), (3, 61), (33, 1)]:
        rows = slice(offset, offset + size)
        out = attend(attention.plan, q[:, rows], k, v, gates={"g_swa": g[:, rows]}, query_offset=offset)
        assert_close(out, expected[:, rows], FORWARD_TOLERANCE, f"rows {rows}")


@in_worker
def test_query_offset_explicit_selection_against_the_reference(rng):
    batch, seq_len, heads_q, heads_kv, head_dim = 2, 80, 6, 3, 16
    q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim)
    indices = random_indices(rng, batch, seq_len, heads_kv, 3, BLOCK)
    g = gate(rng, batch, seq_len, heads_q)
    expected = reference.forward(q, k, v, [reference.selection_mask(indices, 3, BLOCK)], [g], 1 / np.sqrt(head_dim))
    run = jax.jit(lambda q_rows, g_rows, idx, offset: attend(
        SELECTION, q_rows, k, v, gates={"g_slc": g_rows}, block_indices=idx, block_counts=3, query_offset=offset))
    for offset, size in [*shard_rows(seq_len, 5), (0, 1), (33, 1), (79, 1), (21, 30)]:
        rows = slice(offset, offset + size)
        assert_close(run(q[:, rows], g[:, rows], indices[:, rows], offset), expected[:, rows], FORWARD_TOLERANCE, f"rows {rows}")


@in_worker
def test_query_offset_nsa_against_the_paper_reference(rng):
    """Selections of a shard's queries score like the reference's best over the whole sequence
    (compressed keys of the whole sequence, causal prefix before the shard); outputs and
    gradients equal the reference's for those selections. Shards of whole blocks, one query
    (decoding) and a few rows across a sequence boundary."""
    attention, spec = scaled_nsa()
    seq_len, heads_q, heads_kv, head_dim = 96, 4, 2, 16
    cu = np.array([0, 37, 96], np.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    g = {name: gate(rng, 1, seq_len, heads_q) for name in ("cmp", "slc", "swa")}
    _, _, ref_chosen, scores = nsa_reference(q, k, v, spec, gates=g, cu_seqlens=cu)
    names = ("cmp", "slc", "swa")
    for offset, size in ((32, 32), (61, 1), (35, 7)):
        rows = slice(offset, offset + size)
        chosen = np.asarray(jax.jit(lambda q_rows, offset: selections(
            attention.plan, q_rows, k, v, cu_seqlens=cu, query_offset=offset))(q[:, rows], offset)["slc"])
        picked = lambda c, rows=rows: np.sort(
            np.where(c >= 0, np.take_along_axis(scores[:, rows], np.maximum(c, 0), -1), -np.inf), -1)
        np.testing.assert_allclose(picked(chosen), picked(ref_chosen[:, rows]), rtol=1e-4, atol=1e-6)

        full_choice = ref_chosen.copy()
        full_choice[:, rows] = chosen
        expected, _, _, _ = nsa_reference(q, k, v, spec, gates=g, cu_seqlens=cu, selected=full_choice)
        d_out = np.zeros_like(q)
        d_out[:, rows] = normal(rng, 1, size, heads_q, head_dim)
        wanted = nsa_gradients(q, k, v, spec, g, full_choice, d_out, cu_seqlens=cu)
        out, pullback = jax.vjp(
            lambda q_rows, k, v, gs, offset=offset: attend(
                attention.plan, q_rows, k, v, gates={f"g_{n}": x for n, x in zip(names, gs)}, cu_seqlens=cu,
                query_offset=offset),
            q[:, rows], k, v, [g[n][:, rows] for n in names])
        where = f"rows {rows}"
        assert_close(out, expected[:, rows], FORWARD_TOLERANCE, f"output, {where}")
        dq, dk, dv, dgates = pullback(jnp.asarray(d_out[:, rows]))
        assert_close(dq, wanted["q"][:, rows], GRADIENT_TOLERANCE, f"dq, {where}")
        assert_close(dk, wanted["k"], GRADIENT_TOLERANCE, f"dk, {where}")
        assert_close(dv, wanted["v"], GRADIENT_TOLERANCE, f"dv, {where}")
        for name, actual in zip(names, dgates):
            assert_close(actual, wanted[f"g_{name}"][:, rows], GRADIENT_TOLERANCE, f"dg_{name}, {where}")


@in_worker
def test_query_offset_is_validated(rng):
    attention = nsa_dsl.compile(STATIC)
    q, k, v = qkv(rng, 1, 64, 2, 1, 8)
    g = gate(rng, 1, 64, 2)

    def call(q_rows, offset, **options):
        return attend(attention.plan, q_rows, k, v, gates={"g_swa": g[:, : q_rows.shape[1]]}, query_offset=offset, **options)

    for rows, offset, message in (
        (32, 48, r"query_offset must be between 0 and seq_len - query rows = 32, got 48"),
        (1, 64, r"between 0 and seq_len - query rows = 63, got 64"),
        (32, -16, r"got -16"),
        (32, True, r"query_offset must be an int or an integer scalar array"),
        (32, np.zeros(2, np.int32), r"query_offset: one row per batch row must have shape \(1,\), got \(2,\)"),
        (32, np.array([40]), r"query_offset must be between 0 and seq_len - query rows = 32, got \[40\]"),
        (32, np.zeros(1, np.float32), r"query_offset must be an int or an integer scalar array, or an integer \[1\]"),
    ):
        with pytest.raises(ValueError, match=message):
            call(q[:, :rows], offset)
    # A top-k per block(Q) scores groups of queries as one: its shards hold whole blocks.
    grouped = per_block_nsa()
    gates = {name: g[:, :32] for name in ("g_cmp", "g_slc")}
    for rows, offset, message in (
        (32, 8, r"query_offset must be a multiple of the pattern's block \(16\) between 0 and seq_len - query rows = 32, got 8"),
        (24, 0, r"query: a shard of the sequence axis \(24 of key's 64 rows\) must hold a multiple of the pattern's block \(16\)"),
    ):
        with pytest.raises(ValueError, match=message):
            attend(grouped.plan, q[:, :rows], k, v, gates={n: x[:, :rows] for n, x in gates.items()}, query_offset=offset)
    with pytest.raises(ValueError, match=r"key must be \[batch=1, seq_len >= 64"):
        attend(attention.plan, q, k[:, :32], v[:, :32], gates={"g_swa": g}, query_offset=0)
    with pytest.raises(ValueError, match=r"key must be \[batch=1, seq_len=32,"):
        attend(attention.plan, q[:, :32], k, v, gates={"g_swa": g[:, :32]})  # fewer queries only with query_offset
    with pytest.raises(NotImplementedError, match="pallas backend on TPU; here 'xla' supports it"):
        call(q[:, :32], 16, platform="pallas", config=TPU)
