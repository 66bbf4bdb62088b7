"""The public API: native_sparse_attention's ejkernel contract (signature, layouts, gates,
errors that name the argument), compile() and SparseAttention, platforms, check_pattern."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa_dsl
import reference
from conftest import (
    FORWARD_TOLERANCE,
    GRADIENT_TOLERANCE,
    assert_close,
    check_selection_against_reference,
    gate,
    qkv,
    random_indices,
)
from nsa_check import check_against_reference
from nsa_reference import small_example
from static_check import check_static
from nsa_dsl.api import check_pattern, selection_plan
from nsa_dsl.plan import lower
from nsa_dsl.runtime.check import reference_output
from nsa_dsl.runtime.dispatch import choose_platform

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_native_sparse_attention_has_ejkernels_signature():
    parameters = inspect.signature(nsa_dsl.native_sparse_attention).parameters
    positional = ["query", "key", "value", "g_cmp", "g_slc", "block_indices", "block_counts", "cu_seqlens"]
    assert [n for n, x in parameters.items() if x.kind is inspect.Parameter.POSITIONAL_ONLY] == positional
    assert [n for n, x in parameters.items() if x.kind is inspect.Parameter.KEYWORD_ONLY] == ["softmax_scale", "platform", "cfg"]
    assert parameters["block_counts"].default == 16
    assert all(parameters[n].default is None for n in ("g_cmp", "g_slc", "block_indices", "cu_seqlens", "softmax_scale"))


def test_per_query_block_layout_and_default_gate(rng):
    """ejkernel's [B, HKV, num_blocks, S] layout means the per-token rows of each query block;
    g_slc=None weighs the selection 1; cfg.block_size is the key-block size."""
    block, seq_len = 32, 70
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=block)
    q, k, v = qkv(rng, 2, seq_len, 4, 2, 16)
    per_block = rng.integers(-1, 3, (2, 2, 3, 2)).astype(np.int32)
    counts_per_block = rng.integers(0, 3, (2, 2, 3)).astype(np.int32)
    rows = np.arange(seq_len) // block
    per_token = per_block.transpose(0, 2, 1, 3)[:, rows]
    counts_per_token = counts_per_block.transpose(0, 2, 1)[:, rows]

    out = nsa_dsl.native_sparse_attention(q, k, v, None, None, per_block, counts_per_block, cfg=cfg)
    mask = reference.selection_mask(per_token, counts_per_token, block)
    assert_close(out, reference.forward(q, k, v, [mask], [None], 0.25), FORWARD_TOLERANCE, "per-block layout")
    same = nsa_dsl.native_sparse_attention(q, k, v, None, None, per_token, counts_per_token, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


def test_softmax_scale_and_gate(rng):
    q, k, v = qkv(rng, 1, 40, 2, 1, 8)
    g_slc = gate(rng, 1, 40, 2)
    indices = np.tile(np.arange(3, dtype=np.int32), (1, 40, 1, 1))
    out = nsa_dsl.native_sparse_attention(q, k, v, None, g_slc, indices, 2, softmax_scale=0.7)
    mask = reference.selection_mask(indices, 2, 64)
    assert_close(out, reference.forward(q, k, v, [mask], [g_slc], 0.7), FORWARD_TOLERANCE, "scaled, gated")


def _bad_calls():
    """(argument, change to a good call) pairs; the data's values do not matter here."""
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 1, 32, 4, 2, 8)
    idx = np.zeros((1, 32, 2, 2), np.int32)
    g = gate(rng, 1, 32, 4)
    return [
        ("query", dict(query=q[0])),
        ("query", dict(query=None)),
        ("query", dict(query=1.0)),
        ("query", dict(query=q.astype(np.int32), key=k.astype(np.int32), value=v.astype(np.int32))),
        ("key", dict(key=k[:, :16])),
        ("key", dict(key=k.astype(np.float16))),
        ("value", dict(value=v[..., :4])),
        ("key", dict(key=qkv(rng, 1, 32, 4, 3, 8)[1], value=qkv(rng, 1, 32, 4, 3, 8)[2])),  # 4 % 3 != 0
        ("g_slc", dict(g_slc=g[..., :2])),
        ("g_slc", dict(g_slc=g.astype(np.int32))),
        ("block_indices", dict(block_indices=None)),
        ("block_indices", dict(block_indices=idx[0])),
        ("block_indices", dict(block_indices=idx.astype(np.float32))),
        ("block_indices", dict(block_indices=idx[:, :31])),
        ("block_indices", dict(block_indices=idx[..., :0])),
        ("block_counts", dict(block_counts=np.zeros((1, 32, 3), np.int32))),
        ("block_counts", dict(block_counts=np.zeros((1, 32, 2), np.float32))),
        ("block_counts", dict(block_counts=2.5)),
        ("cu_seqlens", dict(cu_seqlens=np.array([[0, 32]]))),
        ("cu_seqlens", dict(cu_seqlens=np.array([0.0, 32.0]))),
        ("cu_seqlens", dict(cu_seqlens=np.array([0, 20, 10, 32]))),
        ("cu_seqlens", dict(cu_seqlens=np.array([0, 40]))),
        ("cu_seqlens", dict(cu_seqlens=[0, 2**70])),  # a list no integer dtype holds
        ("block_counts", dict(block_counts=[[[2**70, 1]] * 32])),
        ("cu_seqlens", dict(query=np.concatenate([q, q]), key=np.concatenate([k, k]), value=np.concatenate([v, v]),
                            block_indices=np.concatenate([idx, idx]), cu_seqlens=np.array([0, 32]))),
        ("block_indices", dict(block_indices=np.zeros((1, 2, 1, 2), np.int32), cu_seqlens=np.array([0, 32]))),
        ("softmax_scale", dict(softmax_scale=np.ones(2, np.float32))),
        ("softmax_scale", dict(softmax_scale=float("inf"))),
        ("softmax_scale", dict(softmax_scale=np.float32("nan"))),  # a concrete array: as a float
        ("softmax_scale", dict(softmax_scale=jnp.asarray(-np.inf, jnp.float32))),
        ("platform", dict(platform="cuda")),
    ], dict(query=q, key=k, value=v, g_slc=None, block_indices=idx, block_counts=2, cu_seqlens=None)


BAD_CALLS, GOOD_CALL = _bad_calls()


@pytest.mark.parametrize("case", range(len(BAD_CALLS)), ids=[f"{i}-{name}" for i, (name, _) in enumerate(BAD_CALLS)])
def test_every_bad_input_is_a_value_error_naming_the_argument(case):
    name, change = BAD_CALLS[case]
    args = {**GOOD_CALL, **change}
    keywords = {key: args.pop(key) for key in ("softmax_scale", "platform") if key in args}
    order = ["query", "key", "value", "g_cmp", "g_slc", "block_indices", "block_counts", "cu_seqlens"]
    with pytest.raises(ValueError, match=name):
        nsa_dsl.native_sparse_attention(*(args.get(n) for n in order), **keywords)


def test_a_bad_cu_seqlens_is_shown_as_given():
    args = {**GOOD_CALL, "cu_seqlens": np.array([0, 2**40])}
    order = ["query", "key", "value", "g_cmp", "g_slc", "block_indices", "block_counts", "cu_seqlens"]
    with pytest.raises(ValueError, match=r"cu_seqlens must .* got \[0, 1099511627776\]$"):
        nsa_dsl.native_sparse_attention(*(args.get(n) for n in order))


@pytest.mark.parametrize("last", [-(2**31), -(2**32) + 40])
def test_a_cu_seqlens_decreasing_past_int32s_range_is_refused(last):
    """int32 differences wrap: 20 to -2**31 read as an increase, and the kernels got it unchecked
    (their output all zeros, the valid first sequence's rows too)."""
    args = {**GOOD_CALL, "cu_seqlens": np.array([0, 1, last], np.int64)}
    order = ["query", "key", "value", "g_cmp", "g_slc", "block_indices", "block_counts", "cu_seqlens"]
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, never decrease"):
        nsa_dsl.native_sparse_attention(*(args.get(n) for n in order))


def test_cu_seqlens_in_the_kernel_objects_softmax_scale_place_is_named():
    """The kernel object keeps ejkernel's Kernel.run order (softmax_scale 8th, cu_seqlens 9th), the
    function takes cu_seqlens 8th: a call moved from one to the other is told which argument it
    passed where."""
    args = [GOOD_CALL[name] for name in ("query", "key", "value")] + [None, None, GOOD_CALL["block_indices"], 2]
    kernel = nsa_dsl.NativeSparseAttention(block_size=16)
    with pytest.raises(ValueError, match=r"softmax_scale must be a real scalar.*cu_seqlens\? .* pass it as cu_seqlens="):
        kernel(*args, np.array([0, 10, 32], np.int32), platform="xla")
    with pytest.raises(ValueError, match=r"softmax_scale must be a real scalar") as error:
        kernel(*args, np.ones(2, np.float32), platform="xla")
    assert "cu_seqlens" not in str(error.value)  # a float array: no hint


@pytest.mark.parametrize("platform", ["xla", "triton", "pallas"])
@pytest.mark.parametrize(
    "given, layout",
    [([0, -30, 20, 48], [0, 0, 20, 48]), ([7, 30, 12, 60], [0, 30, 30, 48])],
    ids=["negative", "not from 0, decreasing, past T"],
)
def test_an_invalid_traced_cu_seqlens_runs_as_the_valid_layout_nearest_it(rng, platform, given, layout):
    """A jitted step's cu_seqlens cannot be checked: an invalid one is clipped to [0, T], starts at 0
    and never decreases on device, so the kernels (NSA with g_cmp: compression, top-k, selection)
    read nothing outside their arrays and give, forward and gradients, what that layout gives as
    a concrete (checked) argument."""
    q, k, v = qkv(rng, 1, 48, 4, 2, 16)
    g_cmp, g_slc = gate(rng, 1, 48, 4), gate(rng, 1, 48, 4)
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=16)

    def loss(q, k, v, cu_seqlens):
        out = nsa_dsl.native_sparse_attention(q, k, v, g_cmp, g_slc, None, 2, cu_seqlens, platform=platform, cfg=cfg)
        return jnp.sum(out * q), out

    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, jnp.asarray(given, jnp.int32))
    checked = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, np.asarray(layout, np.int32))
    for name, got, want in zip(("dq", "dk", "dv", "out"), (*traced[0], traced[1]), (*checked[0], checked[1])):
        assert_close(got, want, 1e-6, name)


def test_a_scoring_query_is_checked_where_no_top_k_reads_it(rng):
    attention = nsa_dsl.compile(EXAMPLES / "sliding_window.nsa")
    q, k, v = qkv(rng, 1, 40, 2, 1, 16)
    with pytest.raises(ValueError, match=r"scoring_query must have shape \(1, 40, 2, 16\)"):
        attention(q[:, 30:], k, v, query_offset=30, scoring_query=np.zeros((7, 3), np.int32), platform="xla")
    np.testing.assert_array_equal(attention(q[:, 30:], k, v, query_offset=30, scoring_query=q, platform="xla"),
                                  attention(q[:, 30:], k, v, query_offset=30, platform="xla"))


LONGFORMER = EXAMPLES / "longformer.nsa"


def test_compile_a_file_with_overrides(rng):
    attention = nsa_dsl.compile(LONGFORMER, window=48)
    assert isinstance(attention, nsa_dsl.SparseAttention)
    assert dict(attention.plan.params)["window"] == 48
    assert attention.plan == lower(attention.pattern)
    q, k, v = qkv(rng, 1, 150, 4, 1, 32)
    branch = attention.plan.branches[0]
    mask = reference.static_mask(branch.static, attention.plan.block_size, True, 1, 150)
    assert_close(attention(q, k, v), reference.forward(q, k, v, [mask], [None], 1 / np.sqrt(32)), FORWARD_TOLERANCE, "longformer")
    source = attention.source("xla")
    assert "pattern `longformer`" in source and "window = 48" in source and "window(48) | global(first=1)" in source


def test_module_path_names_the_file_calls_import(rng):
    """examples/quickstart.py printed codegen.cache_path('xla', plan), a key without the device's
    configuration: a file that was never written, while calls imported another."""
    attention = nsa_dsl.compile(EXAMPLES / "longformer.nsa", window=40)
    path = attention.module_path("xla")
    assert path.read_text() == attention.source("xla")
    attention(*qkv(rng, 1, 80, 2, 1, 8), platform="xla")
    imported = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
    assert str(path) in imported


def test_source_of_a_platform_whose_packages_are_missing_is_rendered(rng, monkeypatch):
    """Rendering needs none of a platform's packages (nsa-compile writes the module without triton):
    source("triton") refused with "platform='triton' is not available" where triton was missing."""
    monkeypatch.setitem(sys.modules, "triton", None)  # importlib.util.find_spec: not installed
    attention = nsa_dsl.compile(EXAMPLES / "longformer.nsa")
    assert "@triton.jit" in attention.source("triton")
    with pytest.raises(ValueError, match="platform='triton' is not available"):  # calls do need it
        attention(*qkv(rng, 1, 16, 1, 1, 8), platform="triton")


SOURCE = """
pattern first
block 16
causal
branch main = window(8)

pattern second
block 16
bidirectional
gate g_near
branch near = local(1, 1) gate g_near
branch far = global(first=1) gate g_slc default 0.5
"""


def test_compile_text_with_declared_and_builtin_gates(rng):
    attention = nsa_dsl.compile(SOURCE, pattern="second")
    assert attention.plan.name == "second"
    q, k, v = qkv(rng, 1, 50, 2, 2, 16)
    g_near, g_slc = gate(rng, 1, 50, 2), gate(rng, 1, 50, 2)
    near, far = (reference.static_mask(b.static, 16, False, 1, 50) for b in attention.plan.branches)
    scale = 0.25
    assert_close(attention(q, k, v, g_near=g_near, g_slc=g_slc),
                 reference.forward(q, k, v, [near, far], [g_near, g_slc], scale), FORWARD_TOLERANCE, "both gates")
    assert_close(attention(q, k, v), 0.5 * reference.forward(q, k, v, [far], [None], scale), FORWARD_TOLERANCE, "defaults")
    with pytest.raises(ValueError, match="g_swa"):
        attention(q, k, v, g_swa=g_near)
    with pytest.raises(ValueError, match="g_other"):
        attention(q, k, v, g_other=g_near)
    with pytest.raises(ValueError, match="block_indices"):
        attention(q, k, v, block_indices=np.zeros((1, 50, 2, 1), np.int32))


def test_gates_the_file_names_but_no_kept_branch_reads_are_taken_and_ignored(rng):
    """A model that passes g_swa broke when `-D use_swa=false` dropped the window branch: the gate
    was "no gate of that name". Gates the file names are taken (checked, not read); others are not."""
    source = (
        "pattern p\nparam use_swa = true\nblock 16\ngate g_extra\n"
        "branch near = local(2)\nbranch swa = window(8) gate g_swa default 1 if use_swa\n"
    )
    attention = nsa_dsl.compile(source, use_swa=False)
    assert attention.plan.idle_gates == ("g_extra", "g_swa")
    q, k, v = qkv(rng, 1, 40, 4, 2, 16)
    near = reference.static_mask(attention.plan.branches[0].static, 16, True, 1, 40)
    expected = reference.forward(q, k, v, [near], [None], 0.25)
    given = {"g_swa": gate(rng, 1, 40, 4), "g_extra": gate(rng, 1, 40, 4)}
    assert_close(attention(q, k, v, **given), expected, FORWARD_TOLERANCE, "idle gates")
    with pytest.raises(ValueError, match=r"g_swa must be \[batch, seq_len, num_q_heads\]"):
        attention(q, k, v, g_swa=gate(rng, 1, 39, 4))
    with pytest.raises(ValueError, match="g_cmp: pattern 'p' has no gate of that name"):
        attention(q, k, v, g_cmp=given["g_swa"])
    assert nsa_dsl.compile(source).plan.idle_gates == ("g_extra",)


def test_compile_reports_located_errors():
    with pytest.raises(nsa_dsl.NsaSemanticError, match="g_slcc"):
        nsa_dsl.compile("pattern p\nblock 16\ncausal\nbranch main = window(8) gate g_slcc\n")
    with pytest.raises(nsa_dsl.NsaSyntaxError):
        nsa_dsl.compile("pattern p\nblock 16\nbranch main = window(8\n")


def test_jit_of_a_compiled_pattern_with_traced_scale(rng):
    import jax

    attention = nsa_dsl.compile(SOURCE, pattern="first")
    q, k, v = qkv(rng, 2, 33, 4, 2, 16)
    run = jax.jit(lambda q, k, v, s: attention(q, k, v, softmax_scale=s))
    mask = reference.static_mask(attention.plan.branches[0].static, 16, True, 2, 33)
    for scale in (0.1, 0.6):
        assert_close(run(q, k, v, jnp.float32(scale)), reference.forward(q, k, v, [mask], [None], scale),
                     FORWARD_TOLERANCE, f"scale {scale}")


def test_check_pattern_report():
    report = check_pattern(lower(nsa_dsl.compile(SOURCE, pattern="second").pattern), 100)
    assert report.ok and report.seq_len == 100 and report.max_error < 1e-4, str(report)
    assert "max relative error" in str(report)
    assert check_pattern(selection_plan(16), 64).ok
    nsa = check_pattern(lower(nsa_dsl.compile(EXAMPLES / "nsa.nsa").pattern), 300)
    assert nsa.ok and nsa.max_error < 1e-4, str(nsa)
    shorter_than_a_compressed_block = check_pattern(nsa_dsl.compile(EXAMPLES / "nsa.nsa").plan, 20)
    assert shorter_than_a_compressed_block.ok, str(shorter_than_a_compressed_block)
    learned = nsa_dsl.compile("pattern p\nblock 16\nbranch c = compress(block=16, pool=learned)\n")
    refused = check_pattern(learned.plan, 64)
    assert not refused.ok and "not checked" in str(refused)


@pytest.mark.parametrize("timing_s, calls", [(0.0, 2), (60.0, 4)])
def test_check_pattern_times_one_call_of_a_slow_kernel(monkeypatch, timing_s, calls):
    """check_pattern times up to TIMED_CALLS calls after the first, but one once TIMING_S passed:
    `nsa-compile --check` ran an interpreted Triton kernel four times, ~25 s each at T 300."""
    from nsa_dsl.runtime import check

    attends, attend = [], check.attend
    monkeypatch.setattr(check, "attend", lambda *args, **kwargs: attends.append(1) or attend(*args, **kwargs))
    monkeypatch.setattr(check, "TIMING_S", timing_s)
    report = check_pattern(selection_plan(16), 64)
    assert report.ok and report.seconds_per_call > 0, str(report)
    assert len(attends) == calls


def test_automatic_platform_is_the_most_specialised_one_with_kernels_for_every_branch(monkeypatch):
    # Decided for devices this machine lacks: Triton on a GPU (with the gpu extra's packages),
    # Pallas (its TPU variant) on a TPU, XLA on a CPU, for every plan.
    from nsa_dsl.runtime import choose_platform

    monkeypatch.setattr("nsa_dsl.runtime.platform.missing_packages", lambda *_: [])

    on = {device: nsa_dsl.NativeSparseAttentionConfig(backend=device) for device in ("cpu", "gpu", "tpu")}
    static = nsa_dsl.compile(EXAMPLES / "longformer.nsa").plan
    nsa = nsa_dsl.compile(EXAMPLES / "nsa.nsa").plan
    assert choose_platform(static, None, on["gpu"]) == "triton"
    assert choose_platform(nsa, None, on["gpu"]) == "triton"
    assert choose_platform(static, None, on["tpu"]) == "pallas"
    assert choose_platform(nsa, None, on["tpu"]) == "pallas"
    assert choose_platform(nsa, None, on["cpu"]) == "xla"
    assert "def topk_kernel" in nsa_dsl.compile(EXAMPLES / "nsa.nsa", config=on["tpu"]).source("pallas")


@pytest.mark.parametrize("platform", ["xla", "triton"])
def test_branch_names_cannot_clash_with_generated_names(rng, platform):
    """Branch names reach generated code only as string keys and as suffixes of prefixed
    functions, so names of the generated code's own variables and helpers are fine."""
    names = ["table", "arrays", "out", "weight", "queries", "selection", "pooled", "selected", "transposed", "offsets"]
    source = "pattern p\nblock 16\n" + "".join(
        f"branch {name} = window({2 + i}) | global(first={1 + i % 2})\n" for i, name in enumerate(names)
    )
    attention = nsa_dsl.compile(source)
    q, k, v = qkv(rng, 1, 40, 2, 1, 8)
    out = attention(q, k, v, platform=platform)
    expected = reference_output(attention.plan, q, k, v)
    assert np.abs(np.asarray(out) - expected).max() <= 1e-4 * np.abs(expected).max()


@pytest.mark.parametrize("platform", ["xla", "triton", "pallas"])
def test_a_branch_named_as_other_branches_joined(rng, platform):
    """Triton runs a and b (key ranges) in one launch and a_b (a table) in its own: the fused
    launch was named a_b too, and the module's second definition replaced the first."""
    attention = nsa_dsl.compile(
        "pattern p\nblock 16\nbranch a = window(8)\nbranch b = local(2)\nbranch a_b = stride(3) - local(1)\n")
    q, k, v = qkv(rng, 1, 70, 2, 1, 8)
    out = attention(q, k, v, platform=platform)
    expected = reference_output(attention.plan, q, k, v)
    assert_close(out, expected, FORWARD_TOLERANCE, platform)


@pytest.mark.parametrize("platform, backend", [("xla", None), ("triton", None), ("pallas", None), ("pallas", "tpu")])
def test_exact_ties_go_to_the_lower_block(rng, platform, backend):
    """README: the top-k breaks exact ties towards the lower block id. One key vector at every
    position makes all compressed keys equal, so a query's complete blocks tie exactly: after its
    forced own block it keeps blocks 0 and 1 (those it has besides its own)."""
    source = (
        "pattern ties\nblock 16\n"
        "branch cmp = compress(block=16, stride=16) gate g_cmp\n"
        "branch slc = topk(3, block=16, score=cmp, force=local(1)) gate g_slc\n"
    )
    q, _, v = qkv(rng, 1, 90, 4, 1, 16)
    k = np.broadcast_to(rng.standard_normal((1, 1, 1, 16)), v.shape).astype(np.float32)
    config = nsa_dsl.NativeSparseAttentionConfig(backend=backend) if backend else None
    chosen = np.asarray(nsa_dsl.compile(source, config=config).selections(q, k, v, platform=platform)["slc"])
    own = np.arange(90) // 16
    expected = np.stack([own, np.where(own > 0, 0, -1), np.where(own > 1, 1, -1)], axis=-1)
    as_sets = lambda blocks: np.sort(np.where(blocks < 0, 1 << 30, blocks), axis=-1)  # noqa: E731
    np.testing.assert_array_equal(as_sets(chosen[0, :, 0]), as_sets(expected))


def test_decoding_one_token_at_a_time_against_a_cache(rng):
    """attention(q_new, k_cache, v_cache, query_offset=t): the new tokens' rows of the whole
    sequence's output, for the NSA example (compression, top-k, window) with packed sequences:
    one query at a time at rows on and off block edges (a sequence's first row, the last), and
    a chunk of several; the cache's rows past a query change nothing (causal). Under jit the
    offset is traced: one program for every position."""
    attention = nsa_dsl.compile(EXAMPLES / "nsa.nsa")
    seq_len, heads_q, heads_kv, head_dim = 200, 4, 2, 16
    cu = jnp.asarray([0, 70, 200], jnp.int32)
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    gates = {name: gate(rng, 1, seq_len, heads_q) for name in ("g_cmp", "g_slc", "g_swa")}
    whole = np.asarray(attention(q, k, v, cu_seqlens=cu, platform="xla", **gates))
    assert np.abs(whole).max() > 0
    stale = np.asarray(rng.standard_normal(k.shape), k.dtype)  # what a cache may hold past a query

    def step(q_new, k_cache, v_cache, gates_new, position):
        return attention(q_new, k_cache, v_cache, cu_seqlens=cu, platform="xla", query_offset=position, **gates_new)

    decode = jax.jit(step)
    for position in (0, 63, 64, 69, 70, 130, 199):
        rows = slice(position, position + 1)
        k_cache, v_cache = (np.where(np.arange(seq_len)[None, :, None, None] > position, stale, x) for x in (k, v))
        out = decode(q[:, rows], k_cache, v_cache, {n: g[:, rows] for n, g in gates.items()}, jnp.int32(position))
        assert_close(out, whole[:, rows], FORWARD_TOLERANCE, f"row {position}")
    assert decode._cache_size() == 1
    chunk = slice(37, 101)  # a prefill chunk across the sequence boundary, off block edges
    out = attention(q[:, chunk], k, v, cu_seqlens=cu, platform="xla", query_offset=37,
                    **{n: g[:, chunk] for n, g in gates.items()})
    assert_close(out, whole[:, chunk], FORWARD_TOLERANCE, "rows 37:101")


@pytest.mark.parametrize(
    "text",
    [
        "pattern p\nblock 16\nbranch w = window(8) gate g_swa\nbranch c = compress(block=536870912) gate g_cmp\n",
        "pattern p\nblock 16\nbranch c = compress(block=16)\nbranch s = topk(3, block=536870912, score=c) gate g_slc\n",
        "pattern p\nblock 536870912\nbranch w = local(1) | window(4)\n",
    ],
    ids=["compress block", "selection block", "pattern block"],
)
def test_blocks_past_the_sequence_match_the_reference(text):
    """Blocks the language allows (up to 2**29 rows) on 40 tokens, against the float64
    reference: both the XLA platform and the reference ran out of memory on them."""
    report = check_pattern(nsa_dsl.compile(text).plan, 40)
    assert report.ok, str(report)


# Each a pattern with a block past 40 tokens, as the language allows (2**29 rows), and the same
# pattern with a block just past them.
_PAST_THE_SEQUENCE = {
    # a pattern block past the keys: every sequence is its block 0
    "pattern block": ("pattern p\nblock 536870912\nbranch w = local(1) | window(4)\n",
                      "pattern p\nblock 64\nbranch w = local(1) | window(4)\n"),
    # a compress block past the keys: it pools nothing
    "compress block": (
        "pattern p\nblock 16\nbranch w = window(8) gate g_swa\nbranch c = compress(block=536870912) gate g_cmp\n",
        "pattern p\nblock 16\nbranch w = window(8) gate g_swa\nbranch c = compress(block=48) gate g_cmp\n",
    ),
    # a selection block past the keys: block 0 holds them all
    "selection block": (
        "pattern p\nblock 16\nbranch c = compress(block=16)\nbranch s = topk(3, block=536870912, score=c) gate g_slc\n",
        "pattern p\nblock 16\nbranch c = compress(block=16)\nbranch s = topk(3, block=64, score=c) gate g_slc\n",
    ),
    # groups of queries past the keys: each sequence's queries share one selection
    "query groups": (
        "pattern p\nblock 536870912\nbranch c = compress(block=16)\n"
        "branch s = topk(2, block=16, score=c) per block(1048576) gate g_slc\n",
        "pattern p\nblock 64\nbranch c = compress(block=16)\nbranch s = topk(2, block=16, score=c) per block(64) gate g_slc\n",
    ),
}


@pytest.mark.parametrize(
    ("target", "case"),
    [(target, case) for target in ("xla", "triton", "pallas", "pallas-tpu") for case in _PAST_THE_SEQUENCE],
)
def test_sizes_past_the_sequence_act_as_its_length(rng, target, case):
    """Blocks past the sequence give the output of the same pattern with a block just past it:
    their gathers, tiles and scores took the block's length, and ran out of memory, hung, or
    made tiles no kernel compiles."""
    platform, _, backend = target.partition("-")
    config = nsa_dsl.NativeSparseAttentionConfig(backend=backend) if backend else None
    huge, usual = _PAST_THE_SEQUENCE[case]
    q, k, v = qkv(rng, 2, 40, 4, 2, 16)
    gates = {name: gate(rng, 2, 40, 4) for name in ("g_swa", "g_cmp", "g_slc") if name in huge}
    want = np.asarray(nsa_dsl.compile(usual, config=config)(q, k, v, platform=platform, **gates))
    assert np.abs(want).max() > 0
    got = np.asarray(nsa_dsl.compile(huge, config=config)(q, k, v, platform=platform, **gates))
    if platform == "xla":  # the same gathers and sums: exactly
        np.testing.assert_array_equal(got, want)
    else:  # the kernels' tiles (and their sums' order) follow the block
        assert_close(got, want, FORWARD_TOLERANCE, case)


@pytest.mark.parametrize("platform", ["xla", "pallas", "triton"])
def test_a_count_past_every_rows_blocks_takes_them_all(rng, platform):
    """topk(n) with n past the sequence's blocks selects each row's every block, whatever n is:
    the same output and selections as n = the blocks (min(n, blocks) columns: padded to n, the
    selections at 2**31 - 1 ran out of memory); a count at the language's limit made arrays of that
    width and aborted the process (XLA, Pallas), or overflowed the kernel's int32 offsets (Triton)."""
    q, k, v = qkv(rng, 1, 70, 4, 2, 16)  # 5 blocks of 16
    g_slc = gate(rng, 1, 70, 4)
    text = "pattern p\nblock 16\nbranch cmp = compress(block=16)\nbranch slc = topk({n}, block=16, score=cmp) gate g_slc\n"
    every = nsa_dsl.compile(text.format(n=5))
    want = np.asarray(every(q, k, v, g_slc=g_slc, platform=platform))
    assert np.abs(want).max() > 0
    for count in (9, 2**31 - 1):
        got = np.asarray(nsa_dsl.compile(text.format(n=count))(q, k, v, g_slc=g_slc, platform=platform))
        np.testing.assert_array_equal(got, want)
    narrow = np.asarray(every.selections(q, k, v, platform=platform)["slc"])
    assert narrow.shape == (1, 70, 2, 5)
    for count in (9, 2**31 - 1):
        wide = nsa_dsl.compile(text.format(n=count)).selections(q, k, v, platform=platform)["slc"]
        np.testing.assert_array_equal(wide, narrow)



@pytest.mark.parametrize("platform", ["xla", "pallas", "triton"])
def test_a_top_k_count_past_int32_takes_every_block(rng, platform):
    """native_sparse_attention(g_cmp=...) with block_counts of 2**31 or more selects every block,
    as any count past the blocks does: it became the top-k's count as it was, and the kernels'
    int32 counts wrapped it negative (XLA and Pallas attended with no selected block, silently)."""
    config = nsa_dsl.NativeSparseAttentionConfig(block_size=16)
    q, k, v = qkv(rng, 1, 45, 4, 2, 8)  # 3 blocks of 16
    g_cmp, g_slc = gate(rng, 1, 45, 4), gate(rng, 1, 45, 4)
    want = np.asarray(nsa_dsl.native_sparse_attention(q, k, v, g_cmp, g_slc, None, 3, platform=platform, cfg=config))
    for count in (2**31, 10**12):
        got = nsa_dsl.native_sparse_attention(q, k, v, g_cmp, g_slc, None, count, platform=platform, cfg=config)
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("platform", ["xla", "triton", "pallas"])
def test_float64_inputs_under_x64_match_the_reference(rng, platform):
    """With jax_enable_x64, float64 inputs run as float32 computations (as every platform
    accumulates) with float64 outputs and gradients: Triton's top-k, whose ranking keys are built
    from 32-bit scores, failed deep inside its interpreter on float64 ones; Pallas was refused."""
    source, spec = small_example("nsa")
    with jax.enable_x64(True):
        check_against_reference(rng, source, spec, batch=1, seq_len=100, heads_q=4, heads_kv=2, head_dim=12,
                                dtype=np.float64, platform=platform)


def test_pallas_under_x64_runs_a_window_on_int64_sequence_offsets(rng):
    """Pallas under jax_enable_x64 was refused: its interpreter mixed the kernels' int32 indices with
    x64's int64 ones when it lowered them. Now float64 inputs run as float32 (the kernels traced,
    differentiated and lowered with x64 off) with float64 outputs and gradients, here a window on
    packed sequences of odd lengths given as int64 offsets, two query heads a KV head."""
    attention = nsa_dsl.compile("pattern p\nblock 16\nbranch main = window(20)\n")
    with jax.enable_x64(True):
        q, k, v = qkv(rng, 1, 75, 4, 2, 24, dtype=np.float64)
        check_static(rng, attention, q, k, v, cu_seqlens=np.array([0, 29, 75], np.int64), platform="pallas")
        assert choose_platform(attention.plan, None, nsa_dsl.NativeSparseAttentionConfig(backend="tpu")) == "pallas"


def test_pallas_under_x64_runs_an_explicit_selection_of_int64_indices(rng):
    """As above, block_indices and block_counts int64 through native_sparse_attention."""

    def selection(q, k, v, g_slc, indices, counts, block, cu_seqlens):
        cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=block)
        return nsa_dsl.native_sparse_attention(q, k, v, None, g_slc, indices, counts, cu_seqlens, platform="pallas", cfg=cfg)

    with jax.enable_x64(True):
        q, k, v = qkv(rng, 1, 45, 6, 2, 16, dtype=np.float64)
        g_slc = gate(rng, 1, 45, 6).astype(np.float64)
        indices = random_indices(rng, 1, 45, 2, 3, 8).astype(np.int64)
        counts = rng.integers(0, 4, (1, 45, 2)).astype(np.int64)
        check_selection_against_reference(rng, selection, q, k, v, g_slc, indices, counts, 8, None,
                                          (FORWARD_TOLERANCE, GRADIENT_TOLERANCE))


@pytest.mark.filterwarnings("error:Explicitly requested dtype float64")
def test_pallas_under_x64_takes_float64_gates_and_scale_beside_float32_inputs(rng):
    """float32 inputs with float64 gates and softmax scale: computed in float32 without JAX's
    warning that it truncated float64 values (Pallas traces with x64 off), the output float32 and
    the gradients of the gate and the scale float64, XLA's."""
    attention = nsa_dsl.compile("pattern p\nblock 16\nbranch main = window(20) gate g_swa\n")
    q, k, v = qkv(rng, 1, 45, 4, 2, 16)
    with jax.enable_x64(True):
        g_swa, scale = jnp.asarray(gate(rng, 1, 45, 4), jnp.float64), jnp.asarray(0.3)

        def loss(q, g_swa, scale, platform):
            out = attention(q, k, v, g_swa=g_swa, softmax_scale=scale, platform=platform)
            return (out**2).sum(), out

        gradients = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnames="platform")
        got, out = gradients(q, g_swa, scale, platform="pallas")
        wanted, want_out = gradients(q, g_swa, scale, platform="xla")
    assert out.dtype == got[0].dtype == jnp.float32 and got[1].dtype == got[2].dtype == jnp.float64
    assert_close(out, want_out, FORWARD_TOLERANCE, "output")
    for name, actual, expected in zip(("dq", "dg_swa", "d softmax_scale"), got, wanted):
        assert_close(actual, expected, GRADIENT_TOLERANCE, name)


def test_pallas_kernels_are_marked_to_lower_without_x64_only_under_x64(rng):
    """x64.pallas_call marks a kernel for its x64-off lowering only where the caller has x64 on:
    with x64 off the program holds plain pallas_calls, as before Pallas ran under x64, forward and
    backward."""
    attention = nsa_dsl.compile("pattern p\nblock 16\nbranch main = window(20)\n")

    def calls_and_marks(q, k, v):
        loss = lambda q: (attention(q, k, v, platform="pallas") ** 2).sum()
        program = str(jax.make_jaxpr(jax.value_and_grad(loss))(q))
        return program.count("pallas_call["), program.count("lowered without x64")

    q, k, v = qkv(rng, 1, 40, 4, 2, 16)
    calls, marks = calls_and_marks(q, k, v)
    assert calls >= 2 and marks == 0
    with jax.enable_x64(True):
        assert calls_and_marks(*(x.astype(np.float64) for x in (q, k, v))) == (calls, calls)


@pytest.mark.parametrize("dtype", ["int8", "int16", "uint16", "uint32", "int64", "uint64"])
def test_integer_arguments_of_any_width_are_their_values(rng, dtype):
    """block_indices, block_counts, cu_seqlens and query_offset as jax arrays of any integer
    dtype mean their values: clamping them into int32's range in their own dtype wrapped the
    bounds (int16, uint32), so every index went out of range and the output was zeros."""
    if dtype in ("int64", "uint64") and not jax.config.jax_enable_x64:
        dtype = dtype.replace("64", "32")
    config = nsa_dsl.NativeSparseAttentionConfig(block_size=16)
    q, k, v = qkv(rng, 1, 40, 2, 1, 8)
    indices = rng.integers(0, 3, (1, 40, 1, 2))
    counts = rng.integers(1, 3, (1, 40, 1))
    cu = np.array([0, 13, 40])

    def call(to):
        return np.asarray(nsa_dsl.native_sparse_attention(q, k, v, None, None, to(indices), to(counts), to(cu),
                                                          cfg=config))

    want = call(lambda x: jnp.asarray(x, jnp.int32))
    assert np.abs(want).max() > 0
    np.testing.assert_array_equal(call(lambda x: jnp.asarray(x, dtype)), want)
    window = nsa_dsl.compile("pattern p\nblock 16\nbranch main = window(20)\n")
    row = np.asarray(window(q, k, v))[:, 30:31]
    step = jax.jit(lambda offset: window(q[:, 30:31], k, v, query_offset=offset))
    for offset in (jnp.asarray(30, dtype), np.asarray(30, dtype)):
        np.testing.assert_allclose(np.asarray(window(q[:, 30:31], k, v, query_offset=offset)), row, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(step(offset)), row, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("platform", ["xla", "triton", "pallas"])
def test_a_learned_pooling_of_the_wrong_shape_is_a_value_error(rng, platform):
    """A pool=learned function must map [C, block, HKV, D] blocks to a pair of [C, HKV, D] keys:
    other results were broadcast into the compressed keys, and the call returned wrong numbers."""
    q, k, v = qkv(rng, 1, 64, 4, 2, 8)
    attention = nsa_dsl.compile("pattern p\nblock 16\nbranch cmp = compress(block=16, stride=8, pool=learned) gate g_cmp\n")
    g_cmp = gate(rng, 1, 64, 4)
    wrong = (lambda kb, vb: (kb.mean((0, 1)), vb.mean((0, 1))), lambda kb, vb: (kb.mean(1)[..., :1], vb.mean(1)[..., :1]),
             lambda kb, vb: (kb.mean(), vb.mean()), lambda kb, vb: (kb.mean(1),),
             lambda kb, vb: (kb.mean(1) > 0, vb.mean(1) > 0))
    for pool in wrong:
        with pytest.raises(ValueError, match=r"pool_fns.*\[C, HKV, D\]"):
            attention(q, k, v, g_cmp=g_cmp, pool_fns={"cmp": pool}, platform=platform)
    mean = attention(q, k, v, g_cmp=g_cmp, pool_fns={"cmp": lambda kb, vb: (kb.mean(1), vb.mean(1))}, platform=platform)
    assert np.isfinite(np.asarray(mean)).all()


def test_a_count_as_an_integer_scalar_array_is_that_count(rng):
    """block_counts as a 0-d integer array: for explicit selections one count for every token
    (traced under jit too); with g_cmp, a concrete one is the top-k's count. Both were refused as
    arrays of the wrong shape."""
    config = nsa_dsl.NativeSparseAttentionConfig(block_size=16)
    q, k, v = qkv(rng, 1, 40, 4, 2, 8)
    indices = rng.integers(-1, 3, (1, 40, 2, 3)).astype(np.int32)
    want = np.asarray(nsa_dsl.native_sparse_attention(q, k, v, None, None, indices, 2, cfg=config))
    assert np.abs(want).max() > 0
    got = nsa_dsl.native_sparse_attention(q, k, v, None, None, indices, jnp.int32(2), cfg=config)
    np.testing.assert_array_equal(np.asarray(got), want)
    traced = jax.jit(lambda count: nsa_dsl.native_sparse_attention(q, k, v, None, None, indices, count, cfg=config))
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(2))), want)
    g_cmp = gate(rng, 1, 40, 4)
    want = np.asarray(nsa_dsl.native_sparse_attention(q, k, v, g_cmp, None, None, 2, cfg=config))
    for count in (jnp.int32(2), np.int64(2), np.array(2)):
        got = nsa_dsl.native_sparse_attention(q, k, v, g_cmp, None, None, count, cfg=config)
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="block_counts"):
        jax.jit(lambda count: nsa_dsl.native_sparse_attention(q, k, v, g_cmp, None, None, count, cfg=config))(2)


def test_gate_and_param_names_cannot_be_the_calls_own_arguments():
    """A gate is passed to the attention call by name, a param override to compile: a gate named
    query (or cu_seqlens, platform, ...) could never be passed, a param named config never
    overridden. The language refuses those names, and its list is the calls' signatures."""
    from nsa_dsl.dsl.check import CALL_ARGUMENTS

    call = set(inspect.signature(nsa_dsl.SparseAttention.__call__).parameters) - {"g_cmp", "g_slc", "g_swa", "extra_gates"}
    written = {}  # a module nsa-compile writes
    exec(nsa_dsl.compile(EXAMPLES / "longformer.nsa").source("xla"), written)
    call |= set(inspect.signature(written["sparse_attention"]).parameters) - {"gates"}
    assert CALL_ARGUMENTS["gate"] == call
    assert CALL_ARGUMENTS["param"] == set(inspect.signature(nsa_dsl.compile).parameters) - {"params"}
    for name in ("query", "cu_seqlens", "platform", "compressed", "config"):
        with pytest.raises(nsa_dsl.NsaSemanticError, match=f"'{name}' cannot name a gate"):
            nsa_dsl.compile(f"pattern p\nblock 16\ngate {name}\nbranch b = local(1) gate {name}\n")
    with pytest.raises(nsa_dsl.NsaSemanticError, match="'config' cannot name a param"):
        nsa_dsl.compile("pattern p\nparam config = 8\nblock 16\nbranch b = window(config)\n")
