"""GPU check of the Triton and Pallas backends: correctness against float64 references.

Run on a machine with a GPU build of jax, triton and jax-triton, from the repository root:

    PYTHONPATH=. python benchmarks/gpu_check.py [--out DIR] [--dtypes ...] [--only CASE,...]
        [--skip-correctness] [--tune T] [--platforms triton,pallas]

1. Correctness: explicit per-token selection through `nsa_dsl.native_sparse_attention(...,
   platform="triton")` (jax-triton kernels) in bfloat16, float16 and float32 on small random
   problems — odd lengths, head dims 60/64/100/128/192, GQA groups 1/3/4/16, per-token
   block_counts, out-of-range and repeated entries, cu_seqlens, the forward token by token and key
   block by key block (the "outer" cases) — forward and the gradients of
   q, k, v and the gate, each against tests/reference.py's float64 dense reference; the same for
   static patterns (window + global, nested set algebra bidirectional, two gated branches on
   packed sequences); and Native Sparse Attention (compression, top-k selection, sliding window;
   the paper's and the mean-pooled configuration, selection per block of queries, packed
   sequences) against tests/nsa_reference.py: the selected blocks' reference scores ("sel": the
   largest gap to the reference's best), outputs and gradients. Reported as max |error| /
   max |reference| per output; "repeat": a second backward's largest difference from the first,
   which must be 0 (the backward uses no atomics: bitwise the same gradients every run).
2. With --tune T: where the time of a selection call goes, and each kernel's tile size and
   launch settings, at length T.
3. With --platforms triton,pallas: the correctness table for each platform in turn (pallas:
   Pallas kernels lowered through Pallas' Triton backend).

Speed against the peers is benchmarks/bench_gpu.py's job (side by side in one run).

Every case runs in its own try/except: a failure is printed and recorded, and the run goes on.
Results go to stdout as tables and to DIR/gpu_check.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import zlib
from importlib import metadata
from typing import NamedTuple
from unittest import mock

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))  # tests/nsa_reference.py imports `reference`
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from module_constants import module_constants  # noqa: E402

import nsa_dsl  # noqa: E402
from nsa_dsl.runtime import triton_glue  # noqa: E402
from tests import reference  # noqa: E402

# max |error| / max |reference| allowed per dtype (float32 runs in full-precision tl.dot).
TOLERANCE = {"float32": 2e-4, "float16": 2e-2, "bfloat16": 4e-2}


def log(*parts) -> None:
    print(*parts, flush=True)


def versions() -> dict:
    out = {"python": platform.python_version(), "devices": [str(d) for d in jax.devices()]}
    for name in ("jax", "jaxlib", "triton", "jax-triton", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "none"
    return out


# ---- correctness ------------------------------------------------------------------------------

CORRECTNESS_CASES = [
    # name, B, T, HQ, HKV, D, S, block, cu_seqlens
    ("mha d64", 2, 111, 4, 4, 64, 4, 16, None),
    ("gqa3 d60", 1, 257, 6, 2, 60, 5, 32, None),
    ("gqa4 d100", 1, 200, 8, 2, 100, 3, 64, None),
    ("gqa16 d128", 1, 300, 16, 1, 128, 4, 64, None),
    ("gqa4 d192", 1, 130, 8, 2, 192, 3, 32, None),
    ("varlen gqa4 d64", 1, 700, 8, 2, 64, 6, 32, [0, 15, 205, 550, 690]),
    ("outer gqa16 d128", 1, 300, 16, 1, 128, 4, 64, None),
    ("outer varlen gqa4", 1, 700, 8, 2, 64, 6, 32, [0, 15, 205, 550, 690]),
    ("outer sliced gqa4", 1, 700, 16, 4, 64, 6, 32, [0, 15, 205, 550, 690]),
]
# Selection cases whose forward runs key block by key block (selection_forward_by_block, its lists in
# segments of 64 rows), which problems this small would not choose (BLOCK_OUTER_PAIRS).
KEY_BLOCK_OUTER = {"outer gqa16 d128", "outer varlen gqa4", "outer sliced gqa4"}
# Of those, the cases whose parts are made and merged, and whose backward stores and reads the score
# gradients, in slices of this many KV heads (NSA_DSL_PAIR_PARTS_SHARE and NSA_DSL_STORED_SCORES_SHARE
# set to hold that many heads' parts and score gradients, as at 128k on an H200): each slice reads
# its inputs and writes its outputs and gradients where its heads lie.
SLICE_HEADS = {"outer sliced gqa4": 2}


def random_problem(rng, B, T, HQ, HKV, D, S, block, cu):
    q = rng.standard_normal((B, T, HQ, D), dtype=np.float32)
    k = rng.standard_normal((B, T, HKV, D), dtype=np.float32)
    v = rng.standard_normal((B, T, HKV, D), dtype=np.float32)
    gate = rng.uniform(0.1, 1.0, (B, T, HQ)).astype(np.float32)
    # ids from -1 to past the causal limit: some entries out of range, some repeated
    indices = rng.integers(-1, -(-T // block) + 1, (B, T, HKV, S)).astype(np.int32)
    counts = rng.integers(0, S + 1, (B, T, HKV)).astype(np.int32)
    d_out = rng.standard_normal((B, T, HQ, D), dtype=np.float32)
    return q, k, v, gate, indices, counts, d_out


def check_case(name, dtype, B, T, HQ, HKV, D, S, block, cu, platform="triton") -> dict:
    outer = name in KEY_BLOCK_OUTER and platform == "triton"
    shares = {}
    if outer and name in SLICE_HEADS:
        memory = triton_glue._device_memory_bytes()
        if memory is None:
            raise RuntimeError("slices of KV heads need a device that reports its memory (a GPU)")
        # One KV head's parts and score gradients, in bytes.
        head_bytes = {"NSA_DSL_PAIR_PARTS_SHARE": B * T * S * (HQ // HKV) * D * jnp.dtype(dtype).itemsize,
                      "NSA_DSL_STORED_SCORES_SHARE": B * T * S * (HQ // HKV) * block * jnp.dtype(dtype).itemsize}
        shares = {variable: repr((SLICE_HEADS[name] + 0.5) * n / memory) for variable, n in head_bytes.items()}
    with contextlib.ExitStack() as stack:
        if outer:
            stack.enter_context(module_constants({"BLOCK_OUTER_PAIRS": 0, "SEGMENT_ROWS": 64}))
        stack.enter_context(mock.patch.dict(os.environ, shares))
        return check_selection(name, dtype, B, T, HQ, HKV, D, S, block, cu, platform)


def check_selection(name, dtype, B, T, HQ, HKV, D, S, block, cu, platform) -> dict:
    rng = np.random.default_rng(zlib.crc32(f"{name} {dtype}".encode()))
    q, k, v, gate, indices, counts, d_out = random_problem(rng, B, T, HQ, HKV, D, S, block, cu)
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=block)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    # the reference sees the same rounded inputs as the kernels
    q, k, v, gate, d_out = (np.asarray(cast(x), np.float64) for x in (q, k, v, gate, d_out))
    cu_arg = None if cu is None else np.asarray(cu, np.int32)

    def f(q, k, v, gate):
        return nsa_dsl.native_sparse_attention(q, k, v, None, gate, indices, counts, cu_arg, platform=platform, cfg=cfg)

    out, vjp = jax.vjp(jax.jit(f), cast(q), cast(k), cast(v), cast(gate))
    grads = vjp(cast(d_out))
    repeat = repeat_gap(grads, vjp(cast(d_out)))
    undifferentiated = jax.jit(f)(cast(q), cast(k), cast(v), cast(gate))
    mask = reference.selection_mask(indices, counts, block, cu)
    scale = 1.0 / math.sqrt(D)
    expected_out = reference.forward(q, k, v, [mask], [gate], scale)
    expected = reference.gradients(q, k, v, [mask], [gate], scale, d_out)
    pairs = {
        "o": (out, expected_out),
        "o nograd": (undifferentiated, expected_out),
        "dq": (grads[0], expected["q"]),
        "dk": (grads[1], expected["k"]),
        "dv": (grads[2], expected["v"]),
        "dgate": (grads[3], expected["gates"][0]),
    }
    return {**relative_errors(pairs), "repeat": repeat}


def static_pattern(name):
    """Static patterns for the correctness table: (SparseAttention, gate names it is given)."""
    from nsa_dsl.api import SparseAttention
    from nsa_dsl.dsl import model
    from nsa_dsl.plan import lower

    W, L, S, G, R = model.Window, model.Local, model.Stride, model.Global, model.Random
    patterns = {
        "window+global": (64, True, [(model.Union((W(200), G(1))), model.Gate("g_swa", None))]),
        "nested bidir": (32, False, [(model.Difference(model.Union((L(2, 1), G(1), R(2, 3))), model.Intersection((S(2, 1), W(40, 40)))), None)]),
        "two gated": (64, True, [(W(100), model.Gate("g_swa", None)), (model.Intersection((W(400), S(2))), model.Gate("g_slc", None))]),
        # trailing windows: forward and backward run the Hopper (Mosaic GPU) kernels where they apply
        "window": (64, True, [(W(300), None)]),
        "causal": (64, True, [(L(2**31 - 1), None)]),
    }
    patterns["window packed"], patterns["causal ragged"] = patterns["window"], patterns["causal"]
    block, causal, branches = patterns[name]
    pattern = model.Pattern("check", block, causal, (), tuple(model.Branch(f"b{i}", keys, g) for i, (keys, g) in enumerate(branches)))
    return SparseAttention(pattern, lower(pattern)), [g.name for _, g in branches if g is not None]


STATIC_CASES = [
    # name, B, T, HQ, HKV, D, cu_seqlens
    ("window+global", 1, 555, 8, 2, 64, None),
    ("nested bidir", 2, 300, 6, 2, 100, None),
    ("two gated", 1, 700, 16, 1, 128, [0, 15, 205, 550, 690]),
    ("window", 2, 1024, 16, 2, 128, None),
    ("causal", 1, 768, 12, 3, 64, None),
    ("window packed", 1, 1000, 16, 2, 128, [0, 100, 101, 477, 900]),  # rows past the last sequence too
    ("causal ragged", 2, 696, 12, 3, 64, None),  # a length that no tile of the kernels divides
]


class PatternRun(NamedTuple):
    """A compiled pattern run on random inputs: the inputs rounded to the run's dtype and held in
    float64 for the reference, and the kernels' output and gradients (q, k, v, then the gates);
    also the output of a call that is not differentiated (which may run other kernels)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    d_out: np.ndarray
    gates: dict
    cu_seqlens: np.ndarray | None
    out: jax.Array
    grads: tuple
    undifferentiated: jax.Array
    repeat: float  # repeat_gap of a second backward


def run_pattern(attention, gate_names, name, dtype, B, T, HQ, HKV, D, cu, platform) -> PatternRun:
    rng = np.random.default_rng(zlib.crc32(f"{name} {dtype}".encode()))
    q, k, v, _, _, _, d_out = random_problem(rng, B, T, HQ, HKV, D, 1, 64, cu)
    gates = {n: rng.uniform(0.1, 1.0, (B, T, HQ)).astype(np.float32) for n in gate_names}
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    q, k, v, d_out = (np.asarray(cast(x), np.float64) for x in (q, k, v, d_out))
    gates = {n: np.asarray(cast(g), np.float64) for n, g in gates.items()}
    cu_arg = None if cu is None else np.asarray(cu, np.int32)

    def f(q, k, v, *gate_values):
        return attention(q, k, v, cu_seqlens=cu_arg, platform=platform, **dict(zip(gate_names, gate_values)))

    inputs = (cast(q), cast(k), cast(v), *(cast(gates[n]) for n in gate_names))
    out, vjp = jax.vjp(jax.jit(f), *inputs)
    grads = vjp(cast(d_out))
    repeat = repeat_gap(grads, vjp(cast(d_out)))
    return PatternRun(q, k, v, d_out, gates, cu_arg, out, grads, jax.jit(f)(*inputs), repeat)


def repeat_gap(grads, again) -> float:
    """The backward is deterministic (no atomics): the largest difference between two runs' gradients
    relative to the largest gradient, 0.0 when they are bitwise equal."""
    gaps = []
    for a, b in zip(grads, again):
        a, b = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (a, b))
        gaps.append(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
    return max(gaps, default=0.0)


def check_static_case(name, dtype, B, T, HQ, HKV, D, cu, platform="triton") -> dict:
    attention, gate_names = static_pattern(name)
    run = run_pattern(attention, gate_names, name, dtype, B, T, HQ, HKV, D, cu, platform)
    q, k, v, d_out, gates, out, grads = run.q, run.k, run.v, run.d_out, run.gates, run.out, run.grads
    plan = attention.plan
    masks = [reference.static_mask(b.static, plan.block_size, plan.causal, B, T, cu) for b in plan.branches]
    branch_gates = [None if b.gate is None else gates[b.gate.name] for b in plan.branches]
    scale = 1.0 / math.sqrt(D)
    expected = reference.gradients(q, k, v, masks, branch_gates, scale, d_out)
    expected_out = reference.forward(q, k, v, masks, branch_gates, scale)
    pairs = {
        "o": (out, expected_out),
        "o nograd": (run.undifferentiated, expected_out),
        "dq": (grads[0], expected["q"]),
        "dk": (grads[1], expected["k"]),
        "dv": (grads[2], expected["v"]),
    }
    if gate_names:
        pairs["dgate"] = (grads[3], next(g for g in expected["gates"] if g is not None))
    return {**relative_errors(pairs), "repeat": run.repeat}


def relative_errors(pairs) -> dict:
    errors = {}
    for key, (got, want) in pairs.items():
        got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
        finite = np.isfinite(got).all()
        errors[key] = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)) if finite else float("inf")
    return errors


NSA_CASES = [
    # name, B, T, HQ, HKV, D, cu_seqlens
    ("nsa paper gqa4 d64", 1, 333, 8, 2, 64, None),
    ("nsa mean gqa16 d128", 1, 700, 16, 1, 128, [0, 15, 205, 550, 690]),
    ("nsa per-block d100", 2, 257, 6, 2, 100, None),
    # one batch row of whole tiles of 8 rows, head dim 128: on an H100/H200 the compression's and the
    # window's forwards run on Hopper (Mosaic GPU) in float16/bfloat16
    ("nsa hopper gqa16 d128", 1, 1000, 16, 1, 128, None),
]


def nsa_pattern(name):
    """NSA patterns for the correctness table: (.nsa text, tests/nsa_reference.py's NsaSpec)."""
    from tests.nsa_reference import NsaSpec

    patterns = {
        # examples/nsa.nsa at block 32: l = 16, d = 8, 4 blocks of 32, window 64
        "nsa paper gqa4 d64": (
            (
                "branch cmp = compress(block=16, stride=8) gate g_cmp\n"
                "branch slc = topk(4, block=32, score=cmp, force=global(first=1) | local(2)) gate g_slc\n"
                "branch swa = window(64) gate g_swa\n"
            ),
            NsaSpec(16, 8, 4, 32, window=64, forced=lambda qb, kb: kb < 1 or qb - 2 < kb <= qb),
        ),
        # examples/nsa_meanpool.nsa at block 32
        "nsa mean gqa16 d128": (
            (
                "branch cmp = compress(block=32, stride=32) gate g_cmp\n"
                "branch slc = topk(6, block=32, score=cmp, force=local(1)) gate g_slc\n"
            ),
            NsaSpec(32, 32, 6, 32, forced=lambda qb, kb: kb == qb),
        ),
        "nsa hopper gqa16 d128": (
            (
                "branch cmp = compress(block=32, stride=16) gate g_cmp\n"
                "branch slc = topk(4, block=32, score=cmp, force=global(first=1) | local(2)) gate g_slc\n"
                "branch swa = window(64) gate g_swa\n"
            ),
            NsaSpec(32, 16, 4, 32, window=64, forced=lambda qb, kb: kb < 1 or qb - 2 < kb <= qb),
        ),
        "nsa per-block d100": (
            (
                "branch cmp = compress(block=32, stride=16) gate g_cmp\n"
                "branch slc = topk(3, block=32, score=cmp, force=global(first=1)) per block(16) gate g_slc\n"
            ),
            NsaSpec(32, 16, 3, 32, query_block=16, forced=lambda qb, kb: kb < 1),
        ),
    }
    branches, spec = patterns[name]
    return "pattern check\nblock 32\ncausal\n" + branches, spec


def check_nsa_case(name, dtype, B, T, HQ, HKV, D, cu, platform="pallas") -> dict:
    from tests.nsa_reference import chosen_scores, nsa_gradients, nsa_reference

    text, spec = nsa_pattern(name)
    attention = nsa_dsl.compile(text)
    gate_names = sorted(g.name for g in attention.plan.gates)
    run = run_pattern(attention, gate_names, name, dtype, B, T, HQ, HKV, D, cu, platform)
    q, k, v, d_out, gates, out, grads = run.q, run.k, run.v, run.d_out, run.gates, run.out, run.grads
    inputs = (jnp.asarray(x, dtype) for x in (q, k, v))
    (chosen,) = attention.selections(*inputs, cu_seqlens=run.cu_seqlens, platform=platform).values()
    chosen = np.asarray(chosen)
    weights = {n.removeprefix("g_"): g for n, g in gates.items()}
    _, _, best, scores = nsa_reference(q, k, v, spec, gates=weights, cu_seqlens=cu)
    # The chosen blocks' reference scores against the reference's best (ties may swap ids).
    got, want = chosen_scores(scores, chosen), chosen_scores(scores, best)
    finite = np.isfinite(want)
    same = (np.isfinite(got) == finite).all()
    selection_gap = float(np.abs(got[finite] - want[finite]).max() / np.abs(want[finite]).max()) if same else float("inf")
    expected, _, _, _ = nsa_reference(q, k, v, spec, gates=weights, cu_seqlens=cu, selected=chosen)
    wanted = nsa_gradients(q, k, v, spec, weights, chosen, d_out, cu_seqlens=cu)
    pairs = {"o": (out, expected), "o nograd": (run.undifferentiated, expected), "dq": (grads[0], wanted["q"]),
             "dk": (grads[1], wanted["k"]), "dv": (grads[2], wanted["v"])}
    pairs["dgate"] = (grads[3], wanted[gate_names[0]])
    return {**relative_errors(pairs), "sel": selection_gap, "repeat": run.repeat}


def run_correctness(dtypes, only=None, platform="triton") -> list[dict]:
    log(f"\n== correctness: {platform} platform vs float64 reference (max |error| / max |reference|) ==")
    log(f"{'case':<18} {'dtype':<9} {'o':>9} {'o nograd':>9} {'dq':>9} {'dk':>9} {'dv':>9} {'dgate':>9} {'repeat':>9}"
        "  verdict (repeat: a second backward's largest difference, must be 0)")
    cases = [("selection", case) for case in CORRECTNESS_CASES] + [("static", case) for case in STATIC_CASES]
    cases += [("nsa", case) for case in NSA_CASES]
    cases = [(kind, case) for kind, case in cases if only is None or case[0] in only]
    rows = []
    for dtype in dtypes:
        for kind, case in cases:
            if kind == "selection":
                name, B, T, HQ, HKV, D, S, block, cu = case
                shape = dict(B=B, T=T, HQ=HQ, HKV=HKV, D=D, S=S, block=block, cu_seqlens=cu)
                check = functools.partial(check_case, name, jnp.dtype(dtype), B, T, HQ, HKV, D, S, block, cu, platform)
            else:
                name, B, T, HQ, HKV, D, cu = case
                shape = dict(B=B, T=T, HQ=HQ, HKV=HKV, D=D, cu_seqlens=cu)
                checker = check_static_case if kind == "static" else check_nsa_case
                check = functools.partial(checker, name, jnp.dtype(dtype), B, T, HQ, HKV, D, cu, platform)
            row = {"kind": kind, "case": name, "dtype": dtype, "shape": shape, "platform": platform}
            try:
                started = time.perf_counter()
                errors = check()
                row["errors"] = errors
                row["seconds"] = time.perf_counter() - started
                accurate = all(e <= TOLERANCE[dtype] for key, e in errors.items() if key != "repeat")
                row["ok"] = accurate and errors["repeat"] == 0.0
                cells = " ".join(f"{errors[k]:9.2e}" if k in errors else f"{'-':>9}"
                                 for k in ("o", "o nograd", "dq", "dk", "dv", "dgate", "repeat"))
                log(f"{name:<18} {dtype:<9} {cells}  {'ok' if row['ok'] else 'FAIL'} ({row['seconds']:.1f} s)")
            except Exception as err:  # noqa: BLE001 - report and go on
                row["ok"] = False
                row["error"] = f"{type(err).__name__}: {err}"
                log(f"{name:<18} {dtype:<9} ERROR {row['error'][:300]}")
                traceback.print_exc()
            rows.append(row)
    return rows


# ---- timing -----------------------------------------------------------------------------------


def random_selection(key, T, HKV, S, block, chunk=4096):
    """[1, T, HKV, S] sorted distinct causal block ids per token (fewer than S valid -> -1 pads
    at the end), drawn on device a chunk of tokens at a time."""

    @jax.jit
    def draw(key, first):
        tokens = first + jnp.arange(chunk)
        num_blocks = -(-T // block)
        scores = jax.random.uniform(key, (chunk, HKV, num_blocks))
        allowed = jnp.arange(num_blocks)[None, None, :] <= (tokens // block)[:, None, None]
        scores = jnp.where(allowed, scores, -1.0)
        top, ids = jax.lax.top_k(scores, S)
        ids = jnp.where(top >= 0, ids, jnp.iinfo(jnp.int32).max)
        ids = jnp.sort(ids, axis=-1)
        return jnp.where(ids == jnp.iinfo(jnp.int32).max, -1, ids).astype(jnp.int32)

    parts = [draw(jax.random.fold_in(key, i), i * chunk) for i in range(-(-T // chunk))]
    return jnp.concatenate(parts)[:T][None]


def median_ms(fn, *args, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def run_tuning(T, HQ=64, HKV=4, D=128, S=16, block=64, dtype="bfloat16") -> dict:
    """Where the time of a selection call goes at one length, both orders of its backward, and the
    launch settings of the backward kernels."""
    from nsa_dsl import api, codegen
    from nsa_dsl.runtime import layout

    log(f"\n== tuning at T={T}: B=1 HQ={HQ} HKV={HKV} D={D} S={S} block={block} {dtype} ==")
    module = codegen.load_module("triton", api.selection_plan(block), nsa_dsl.NativeSparseAttentionConfig(block_size=block))
    key = jax.random.PRNGKey(1)
    kq, kk, kv, ks, kd = jax.random.split(key, 5)
    q = jax.random.normal(kq, (T, HQ, D), dtype)
    k = jax.random.normal(kk, (T, HKV, D), dtype)
    v = jax.random.normal(kv, (T, HKV, D), dtype)
    d_out = jax.random.normal(kd, (T, HQ, D), dtype)
    indices = random_selection(ks, T, HKV, S, block)[0]
    counts = jnp.full((T, HKV), S, jnp.int32)
    scale = jnp.full((1,), 1.0 / math.sqrt(D), jnp.float32)
    offsets = layout.sequence_offsets(None, 1, T)
    queries = layout.QueryRows.shard(0, T, 1)
    spec = module.Selection(block, HKV, HQ // HKV, D, S)
    rows = layout.rows(offsets, T)

    def clean(indices):
        return layout.clean_selection(indices, counts, rows, block)

    selected = jax.jit(clean)(indices)

    def forward(q, k, v, selected):
        return module._selection_forward(spec, q, k, v, scale, selected, offsets, queries)

    def backward(residuals, d_out):
        return module._selection_backward(spec, residuals, d_out)[:3]

    def pair_lists(selected):
        return layout.selection_by_key_block(selected, rows.seq, layout.sequence_blocks(offsets, T, block))

    def timed(fn, *args, repeats=10, warmup=2):
        # a new function object each time: jit must trace again under the module's current settings
        return median_ms(jax.jit(functools.partial(fn)), *args, repeats=repeats, warmup=warmup)

    residuals = jax.jit(forward)(q, k, v, selected)[1]
    result = {"T": T, "breakdown": {}, "settings": []}
    parts = {
        "clean_selection": (clean, (indices,)),
        "forward (kernel + rows)": (lambda *a: forward(*a)[0], (q, k, v, selected)),
        "pair lists (sort)": (pair_lists, (selected,)),
        "backward, dq from stored ds": (backward, (residuals, d_out)),
    }
    for name, (fn, args) in parts.items():
        try:
            result["breakdown"][name] = ms = timed(fn, *args)
            log(f"  {name:<34} {ms:8.2f} ms")
        except Exception as err:  # noqa: BLE001
            log(f"  {name:<34} ERROR {type(err).__name__}: {err}")
    fits = triton_glue.fits_device_memory
    triton_glue.fits_device_memory = lambda nbytes, share: False
    try:
        result["breakdown"]["backward, dq recomputing ds"] = ms = timed(backward, residuals, d_out)
        log(f"  {'backward, dq recomputing ds':<34} {ms:8.2f} ms")
    except Exception as err:  # noqa: BLE001
        log(f"  backward, dq recomputing ds ERROR {type(err).__name__}: {err}")
    finally:
        triton_glue.fits_device_memory = fits
    # The backward kernels of the stored order in turn, the others at their defaults: the tile
    # (DQ_STEP_KEYS keys a step of dq, PAIR_ROWS tile rows a step of dk/dv) and launch settings.
    sweeps = {
        "selection_backward_dq_from_scores": ("DQ_STEP_KEYS", (64, 128), ((4, 2), (4, 3), (8, 2))),
        "selection_backward_dkdv": ("PAIR_ROWS", (32, 64, 128), ((4, 2), (8, 2))),
    }
    default = dict(module.LAUNCH)
    log(f"  {'kernel':<34} {'tile':>16} {'warps':>5} {'stages':>6} {'bwd ms':>8}")
    for kernel, (tile, sizes, launches) in sweeps.items():
        default_tile = getattr(module, tile)
        for size in sizes:
            setattr(module, tile, size)
            for warps, stages in launches:
                module.LAUNCH[kernel] = (warps, stages)
                setting = {"kernel": kernel, tile: size, "num_warps": warps, "num_stages": stages}
                label = f"{kernel:<34} {tile + '=' + str(size):>16} {warps:>5} {stages:>6}"
                try:
                    setting["ms"] = timed(backward, residuals, d_out, repeats=5, warmup=1)
                    log(f"  {label} {setting['ms']:8.2f}")
                except Exception as err:  # noqa: BLE001
                    setting["error"] = f"{type(err).__name__}: {str(err)[:200]}"
                    log(f"  {label} ERROR {setting['error']}")
                result["settings"].append(setting)
        setattr(module, tile, default_tile)
        module.LAUNCH[kernel] = default[kernel]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32", help="dtypes of the correctness table")
    parser.add_argument("--only", help="comma-separated names of the correctness cases to run (default: all)")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--tune", type=int, default=0, metavar="T", help="also time launch settings at length T")
    parser.add_argument("--platforms", default="triton", help="comma-separated platforms to check: triton, pallas")
    args = parser.parse_args()
    platforms = args.platforms.split(",")

    info = versions()
    log("versions:", json.dumps(info))
    if jax.default_backend() != "gpu":
        log("warning: jax has no GPU here; the triton platform runs in the interpreter (slow)")
    result = {"versions": info, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not args.skip_correctness:
        only = args.only.split(",") if args.only else None
        result["correctness"] = [row for p in platforms for row in run_correctness(args.dtypes.split(","), only, p)]
    if args.tune:
        result["tuning"] = run_tuning(args.tune)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"\nwrote {path}")


if __name__ == "__main__":
    main()
