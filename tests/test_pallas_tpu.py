"""The TPU (Mosaic) variant of the Pallas backend, rendered for
NativeSparseAttentionConfig(backend="tpu"): explicit selection and static branches, their block
tables scalar-prefetched. No TPU here: the kernels run in Pallas' interpreter against the float64
reference (output; gradients of q, k, v, the gates and, in float32, the softmax scale) on odd
lengths, head dims 8 to 24, GQA groups 1, 3 and 16 and packed sequences with an empty one and
rows in none; on the TPU's (8, 128)-padded tile layouts (bfloat16); once in the TPU interpreter
(pltpu.InterpretParams), which simulates the TPU's memories; and lowered (not run) for a TPU
from the CPU, which runs Pallas' Mosaic lowering and its block-shape checks but not the Mosaic
compiler (only a TPU's runtime has it). Interpreted grid steps run one at a time: shapes are
small."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from conftest import (
    BF16_TOLERANCE,
    FORWARD_TOLERANCE,
    GRADIENT_TOLERANCE,
    assert_close,
    check_selection_against_reference,
    gate,
    normal,
    qkv,
    random_indices,
)
from jax.experimental.pallas import tpu as pltpu
from jax.extend.core import ClosedJaxpr, Jaxpr

import nsa_dsl
from nsa_dsl import codegen
from nsa_dsl.dsl import model
from nsa_dsl.plan import lower_keys
from nsa_dsl.plan import plan as p
from nsa_dsl.runtime import attend

TPU = nsa_dsl.NativeSparseAttentionConfig(backend="tpu")
# The TPU interpreter runs on the CPU device, also where a GPU is the default: on the GPU machine its
# callbacks found its global simulated memory unset (an assertion in jax's interpret_pallas_call).
CPU = jax.devices("cpu")[0]
W, L, S, G, R = model.Window, model.Local, model.Stride, model.Global, model.Random


def mixed_plan(name, block, select_block):
    """A static branch (full and partial entries, atom bits) and an explicit selection: every
    kernel of the variant."""
    keys = model.Union((W(11), G(1), model.Difference(S(3, 1), L(1))))
    static = p.StaticBranch("swa", model.Gate("g_swa", 0.5), lower_keys(keys))
    select = p.SelectBranch("slc", model.Gate("g_slc", 1.0), select_block)
    return p.Plan(name=name, block_size=block, causal=True, params=(), branches=(static, select))


class Case:
    """Fresh inputs for a plan of static and explicit-selection branches (every gate passed),
    its run through nsa_dsl.runtime.attend, and the float64 reference."""

    def __init__(self, rng, plan, batch, seq_len, heads_q, heads_kv, head_dim, cu_seqlens=None, dtype=np.float32):
        self.plan = plan
        self.module = codegen.load_module("pallas", plan, TPU)  # the module attend runs: tests patch its settings
        self.cu_seqlens = None if cu_seqlens is None else np.array(cu_seqlens, dtype=np.int32)
        q, k, v = qkv(rng, batch, seq_len, heads_q, heads_kv, head_dim, dtype=dtype)
        gates = {b.gate.name: gate(rng, batch, seq_len, heads_q).astype(dtype) for b in plan.branches}
        self.inputs = (q, k, v, gates, np.float32(0.3))
        self.masks, self.selection = [], {}
        for branch in plan.branches:
            if isinstance(branch, p.StaticBranch):
                self.masks.append(
                    reference.static_mask(branch.static, plan.block_size, plan.causal, batch, seq_len, self.cu_seqlens)
                )
            else:
                indices = random_indices(rng, batch, seq_len, heads_kv, 3, branch.block, self.cu_seqlens)
                counts = rng.integers(0, 4, (batch, seq_len, heads_kv)).astype(np.int32)
                self.selection = {"block_indices": indices, "block_counts": counts}
                self.masks.append(reference.selection_mask(indices, counts, branch.block, self.cu_seqlens))
        self.d_out = normal(rng, batch, seq_len, heads_q, head_dim)

    def attention(self, q, k, v, gates, scale):
        return attend(
            self.plan, q, k, v, gates=gates, cu_seqlens=self.cu_seqlens, softmax_scale=scale, platform="pallas",
            config=TPU, **self.selection,
        )

    def check(self, forward_tolerance=FORWARD_TOLERANCE, gradient_tolerance=GRADIENT_TOLERANCE):
        """The output and the gradients in q, k, v, the gates and the scale against float64. (Not
        the scale's in bfloat16: d scale = sum(q . dq) / scale adds up rounded terms that mostly
        cancel.)"""

        @jax.jit
        def run(*inputs):
            out, pullback = jax.vjp(self.attention, *inputs)
            return out, pullback(jnp.asarray(self.d_out, out.dtype))

        gate_names = [b.gate.name for b in self.plan.branches]
        with jax.enable_x64(True):

            @jax.jit  # one compilation instead of dozens of eager float64 ops
            def dense(*inputs):
                def gated(q, k, v, gates, scale):
                    return reference.gated_attention(q, k, v, self.masks, [gates[n] for n in gate_names], scale, jnp)

                out, pullback = jax.vjp(gated, *inputs)
                return out, pullback(jnp.asarray(self.d_out, jnp.float64))

            inputs64 = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), self.inputs)
            wanted_out, wanted_grads = dense(*inputs64)
        out, grads = run(*self.inputs)
        dtype = self.inputs[0].dtype
        assert out.dtype == dtype
        assert_close(out, wanted_out, forward_tolerance, "output")
        names = ("dq", "dk", "dv", "dgates") + (("dscale",) if dtype == np.float32 else ())
        for name, actual, wanted in zip(names, grads, wanted_grads):
            for part, (got, want) in enumerate(zip(jax.tree.leaves(actual), jax.tree.leaves(wanted))):
                assert got.dtype == (np.float32 if name == "dscale" else dtype)
                assert_close(np.reshape(got, -1), np.reshape(want, -1), gradient_tolerance, f"{name}[{part}]")


def test_forward_and_gradients(rng):
    """Group 1 over two batch rows, T not a multiple of either block, head dim 16."""
    Case(rng, mixed_plan("tpu_group1", 8, 16), 2, 37, 2, 2, 16).check()


def test_tpu_tile_layouts_in_bfloat16(rng, monkeypatch):
    """On a TPU the group, blocks and head dim are padded to (8 sublanes, 128 lanes) tiles: here
    16 query heads of one KV head, blocks of 12 and 6 (-> 16, 8), head dim 24 (-> 128), packed
    sequences with an empty one and rows in none. The same kernels on those layouts, interpreted."""
    case = Case(rng, mixed_plan("tpu_tiles", 12, 6), 1, 32, 16, 1, 24, [0, 13, 13, 29], dtype=jnp.bfloat16)
    monkeypatch.setattr(case.module, "TPU_TILES", True)
    case.check(BF16_TOLERANCE, BF16_TOLERANCE)


def test_bidirectional_static_branch_on_packed_sequences(rng):
    """Drawn blocks and table rows past a sequence's end (one table serves every sequence);
    group 3 over two KV heads, head dim 20."""
    keys = model.Union((L(1, 1), R(2, 9)))
    plan = p.Plan("tpu_bidirectional", 8, False, (), (p.StaticBranch("b", model.Gate("g_b"), lower_keys(keys)),))
    Case(rng, plan, 1, 64, 6, 2, 20, [0, 15, 40, 40, 61]).check()


def test_tpu_interpreter(rng, monkeypatch):
    """Explicit selection through the public API in Pallas' TPU interpreter, which copies blocks
    between simulated HBM and VMEM as a TPU's pipeline does: buffers start as NaN and a read out
    of bounds raises. No token selects key block 1, so its dk, dv come from no kernel step and
    must be zeros; tokens 0..2 select nothing. (The block size is used by no other test, so the
    runtime's jitted kernel is traced here, with the interpreter.)"""
    block = 5
    cfg = nsa_dsl.NativeSparseAttentionConfig(block_size=block, backend="tpu")
    module = codegen.load_module("pallas", nsa_dsl.api.selection_plan(block), cfg)
    monkeypatch.setattr(module, "INTERPRET", pltpu.InterpretParams())
    q, k, v = qkv(rng, 1, 17, 3, 1, 8)
    indices = random_indices(rng, 1, 17, 1, 3, block)
    indices[indices == 1] = 0
    indices[0, :3] = -1
    counts = rng.integers(1, 4, (1, 17, 1)).astype(np.int32)

    def selection(q, k, v, g_slc, indices, counts, block, cu_seqlens):
        return nsa_dsl.native_sparse_attention(
            q, k, v, None, g_slc, indices, counts, cu_seqlens, platform="pallas", cfg=cfg
        )

    g_slc = gate(rng, 1, 17, 3)
    tolerances = (FORWARD_TOLERANCE, GRADIENT_TOLERANCE)
    with jax.default_device(CPU):
        check_selection_against_reference(rng, selection, q, k, v, g_slc, indices, counts, block, None, tolerances)


def pallas_calls(jaxpr):
    """(name, scalar-prefetched operands) of every pallas_call in a jaxpr and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params["name"], eqn.params["grid_mapping"].num_index_operands
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(inner, ClosedJaxpr):
                    yield from pallas_calls(inner.jaxpr)
                elif isinstance(inner, Jaxpr):
                    yield from pallas_calls(inner)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_for_a_tpu(rng, monkeypatch, dtype):
    """Lower (not run) forward and backward for a TPU from the CPU: every kernel goes through
    Pallas' Mosaic lowering (supported primitives, block shapes on (8, 128) tiles) and takes its
    schedule (block tables) by scalar prefetch."""
    case = Case(rng, mixed_plan(f"tpu_lowering_{jnp.dtype(dtype).name}", 8, 16), 1, 45, 6, 2, 24, dtype=dtype)
    monkeypatch.setattr(case.module, "TPU_TILES", True)
    monkeypatch.setattr(case.module, "INTERPRET", False)

    def loss(*inputs):
        return jnp.sum(case.attention(*inputs).astype(jnp.float32))

    forward = {"static_forward": 8, "selection_forward": 5}
    backward = {
        "static_backward_dq": 8, "static_backward_dkdv": 8, "selection_backward_dq": 5, "selection_backward_dkdv": 5
    }
    for function, kernels in ((loss, forward), (jax.grad(loss, argnums=(0, 1, 2, 3, 4)), forward | backward)):
        traced = jax.jit(function).trace(*case.inputs)
        assert sorted(pallas_calls(traced.jaxpr.jaxpr)) == sorted(kernels.items())
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
        assert sorted(re.findall(r'kernel_name = "(\w+)"', text)) == sorted(kernels)


def test_launch_loops_lower_for_a_tpu(rng, monkeypatch):
    """The selection kernels' loops of launches (scalar memory patched down to 300 bytes), the
    dk/dv launches updating their block sums in place, lower for a TPU from the CPU."""
    case = Case(rng, selection_plan("tpu_lower_launches", 8), 1, 45, 6, 2, 24, dtype=jnp.bfloat16)
    monkeypatch.setattr(case.module, "TPU_TILES", True)
    monkeypatch.setattr(case.module, "INTERPRET", False)
    monkeypatch.setattr(case.module, "SCALAR_MEMORY_BYTES", 300)

    def loss(*inputs):
        return jnp.sum(case.attention(*inputs).astype(jnp.float32))

    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*case.inputs)
    text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert sorted(re.findall(r'kernel_name = "(\w+)"', text)) == [
        "selection_backward_dkdv", "selection_backward_dq", "selection_forward"
    ]
    assert "stablehlo.while" in text


def test_the_runtime_renders_the_tpu_variant_for_backend_tpu():
    plan = mixed_plan("tpu_source", 8, 8)
    tpu_source = codegen.source("pallas", plan, TPU)
    gpu_source = codegen.source("pallas", plan, nsa_dsl.NativeSparseAttentionConfig(backend="gpu"))
    assert "PrefetchScalarGridSpec" in tpu_source and "pltriton" not in tpu_source.split("# ---- TPU")[1]
    assert "PrefetchScalarGridSpec" not in gpu_source


def selection_plan(name, block):
    return p.Plan(name=name, block_size=block, causal=True, params=(),
                  branches=(p.SelectBranch("slc", model.Gate("g_slc", 1.0), block),))


@pytest.mark.parametrize("interpret", ["pallas", "tpu"])
def test_schedules_longer_than_scalar_memory_run_in_several_launches(rng, monkeypatch, interpret):
    """Scalar memory patched down to 276 bytes: the selection's forward and dq run in 8 launches
    of 6 of the 45 tokens (the last padded), its dk/dv in 11 launches of 13 of each KV head's 135
    pairs, each adding to the block sums the earlier ones left (blocks straddle launches); the
    static branch's (a window, a global block, a stride) forward, dq and dk/dv in launches of 2 of
    the 7 query tiles or key blocks (the transposed table is as wide as a sequence's blocks, for the
    global one). Packed sequences, group 3. Output and gradients against float64, in Pallas'
    interpreter and in the TPU interpreter (whose buffers start as NaN: a launch that did not
    update the sums in place, or wrote another launch's rows, would show)."""
    with jax.default_device(CPU if interpret == "tpu" else None):
        case = Case(rng, mixed_plan(f"tpu_launches_{interpret}", 8, 8), 1, 45, 6, 2, 16, [0, 20, 45])
        monkeypatch.setattr(case.module, "SCALAR_MEMORY_BYTES", 276)
        if interpret == "tpu":
            monkeypatch.setattr(case.module, "INTERPRET", pltpu.InterpretParams())
        grids = {}
        real = case.module.pallas_call

        def recording(kernel, **options):
            grids[options["name"]] = options["grid_spec"].grid
            return real(kernel, **options)

        monkeypatch.setattr(case.module, "pallas_call", recording)
        case.check()
    assert grids == {
        "selection_forward": (2, 6, 3), "selection_backward_dq": (2, 6, 3), "selection_backward_dkdv": (2, 13),
        "static_forward": (2, 2, 5), "static_backward_dq": (2, 2, 5), "static_backward_dkdv": (2, 2, 6),
    }


def long_selection(rng):
    """A selection plan and inputs whose per-token schedule (4 bytes per token, KV head and entry:
    16384 x 1 x 16) alone fills a TPU core's 1 MiB of scalar memory."""
    plan = selection_plan("tpu_long", 64)
    seq_len, width = 16384, 16
    q, k, v = qkv(rng, 1, seq_len, 2, 1, 8)
    selection = {"block_indices": random_indices(rng, 1, seq_len, 1, width, 64), "block_counts": width}
    return plan, (q, k, v), {"g_slc": gate(rng, 1, seq_len, 2)}, selection


def test_a_schedule_longer_than_scalar_memory_is_a_clear_error(rng, monkeypatch):
    """Where not even one token's schedule fits beside the key blocks' geometry (scalar memory
    patched down to 1 KB: the 256 blocks' first and end rows take 2 KB), the TPU variant asked
    for by name refuses while tracing (nothing runs) and says why and what to use, instead of
    leaving Mosaic's compiler to fail on the TPU."""
    plan, (q, k, v), gates, selection = long_selection(rng)
    monkeypatch.setattr(codegen.load_module("pallas", plan, TPU), "SCALAR_MEMORY_BYTES", 1024)
    with pytest.raises(nsa_dsl.PlatformLimitError,
                       match=r"selection_forward would scalar-prefetch \d+ bytes.*scalar memory.*platform='xla'"):
        jax.eval_shape(lambda q, k, v: attend(plan, q, k, v, gates=gates, platform="pallas", config=TPU, **selection),
                       q, k, v)


def test_an_automatic_choice_gives_way_to_xla_for_a_schedule_too_long(rng, monkeypatch):
    """Chosen automatically (the TPU's most specialised platform), the TPU variant gives way to
    XLA with a warning: the output is XLA's, bit for bit."""
    plan, (q, k, v), gates, selection = long_selection(rng)
    monkeypatch.setattr(codegen.load_module("pallas", plan, TPU), "SCALAR_MEMORY_BYTES", 1024)
    with pytest.warns(UserWarning, match="scalar memory.*on XLA instead"):
        automatic = attend(plan, q, k, v, gates=gates, config=TPU, **selection)
    by_xla = attend(plan, q, k, v, gates=gates, platform="xla", config=TPU, **selection)
    np.testing.assert_array_equal(np.asarray(automatic), np.asarray(by_xla))
    assert np.abs(np.asarray(by_xla)).max() > 0
