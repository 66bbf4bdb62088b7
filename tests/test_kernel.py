"""The Kernel interface (nsa_dsl/kernel.py): invocations and their keys, the registry of
implementations and its errors, platform choice, configurations and their legality, the
candidates of every platform -- which never change the result -- and their settings reaching
the generated kernels. Autotuning itself is tested in test_autotune.py."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FORWARD_TOLERANCE, assert_close, gate, qkv, random_indices

import nsa_dsl
from nsa_dsl import codegen, kernel
from nsa_dsl.config import NativeSparseAttentionConfig as Config

BLOCK = 16
# jax's device as Kernel.candidate_cfgs names it, and the platform an automatic choice takes there
# (Triton on a GPU: the GPU machine has jax-triton).
DEVICE = {"gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "xla")
AUTOMATIC = {"gpu": "triton", "tpu": "pallas", "xla": "xla"}[DEVICE]


def inputs(rng, seq_len=40, heads_q=4, heads_kv=2, head_dim=16, width=3):
    q, k, v = qkv(rng, 1, seq_len, heads_q, heads_kv, head_dim)
    return q, k, v, random_indices(rng, 1, seq_len, heads_kv, width, BLOCK)


# ---- invocations ------------------------------------------------------------------------------


def test_invocation_binds_runs_parameters_and_keys_on_shapes_dtypes_and_statics(rng):
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    q, k, v, indices = inputs(rng)
    inv = nsa.invocation(q, k, v, None, None, indices, 3, 0.7)
    assert list(inv.arguments) == [n for n in inspect.signature(nsa.run).parameters if n != "cfg"]
    assert inv.arguments["block_counts"] == 3 and inv.arguments["platform"] is None and inv.static == {"block_size": BLOCK}
    assert inv.signature["arguments"]["query"] == {"shape": [1, 40, 4, 16], "dtype": "float32"}
    assert inv.signature["arguments"]["softmax_scale"] == "float"  # a scale changes numbers, not code

    # Values do not matter, shapes, dtypes, ints and the kernel's settings do.
    assert nsa.invocation(-q, k, v, None, None, indices + 1, 3, 0.3).key == inv.key
    different = [
        nsa.invocation(q[:, :32], k[:, :32], v[:, :32], None, None, indices[:, :32], 3, 0.7),
        nsa.invocation(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), None, None, indices, 3, 0.7),
        nsa.invocation(q, k, v, None, None, indices, 2, 0.7),
        nsa.invocation(q, k, v, None, None, indices, 3, 0.7, None, "triton"),
        nsa_dsl.NativeSparseAttention(block_size=32).invocation(q, k, v, None, None, indices, 3, 0.7),
        nsa.invocation(q, k, v, None, None, indices, 3, 0.7, method="shard_map"),
    ]
    assert len({inv.key, *(d.key for d in different)}) == len(different) + 1

    # Tracers and abstract values key the same as the arrays they stand for.
    seen = []
    jax.jit(lambda q: seen.append(nsa.invocation(q, k, v, None, None, indices, 3, 0.7).key) or q)(q)
    abstract = nsa.invocation(jax.ShapeDtypeStruct(q.shape, q.dtype), k, v, None, None, indices, 3, 0.7)
    assert seen == [inv.key] and abstract.key == inv.key

    with pytest.raises(ValueError, match="method"):
        kernel.Invocation("op", {}, method="vmap")
    with pytest.raises(TypeError):
        inv.arguments["query"] = q  # frozen


# ---- registry and platforms ---------------------------------------------------------------------


def test_registry_is_keyed_by_platform_and_backend_and_names_what_is_available():
    impl = kernel.implementation("native_sparse_attention", "xla", "gpu")  # registered for "any" device
    assert impl is kernel.implementation("native_sparse_attention", "xla", "cpu")
    assert kernel.implementation("native_sparse_attention", "pallas", "tpu").keywords == {"platform": "pallas"}
    with pytest.raises(ValueError, match=r"platform='triton' on backend='tpu'; available: pallas on cpu, .*triton on gpu"):
        kernel.implementation("native_sparse_attention", "triton", "tpu")
    with pytest.raises(ValueError, match="available: none"):
        kernel.implementation("no_such_op", "xla", "cpu")
    with pytest.raises(ValueError, match="backend must be"):
        kernel.register("native_sparse_attention", "xla", "npu", print)

    nsa = nsa_dsl.NativeSparseAttention()
    assert nsa.get_impl(Config(platform="xla")).keywords == {"platform": "xla"}
    assert nsa.get_impl(Config()).keywords == {"platform": AUTOMATIC}
    assert nsa.get_impl(Config(platform="triton")).keywords == {"platform": "triton"}  # on a CPU its interpreter
    with pytest.raises(ValueError, match=r"platform='triton' is not available: it needs a GPU .* available: pallas, xla"):
        nsa.get_impl(Config(platform="triton", backend="tpu"))


def test_a_kernel_registered_by_a_user_is_found_and_called(rng):
    class Doubled(kernel.Kernel):
        op_id = "test_doubled"
        config_type = Config

        def run(self, x, *, cfg):
            return self.get_impl(cfg)(x)

        def heuristic_cfg(self, inv):
            return Config(platform="xla")

    kernel.register("test_doubled", "xla", "any", lambda x: 2 * x)
    x = rng.standard_normal(3)
    np.testing.assert_array_equal(Doubled()(x, cfg="heuristic"), 2 * x)
    assert Doubled().candidate_cfgs(Doubled().invocation(x)) == [Config(platform="xla")]


def test_automatic_platform_and_platforms_that_cannot_run(rng):
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    q, k, v, indices = inputs(rng)
    assert nsa.heuristic_cfg(nsa.invocation(q, k, v, None, None, indices, 3)).platform == AUTOMATIC
    assert nsa.heuristic_cfg(nsa.invocation(q, k, v, None, None, indices, 3, None, None, "auto")).platform == AUTOMATIC
    assert nsa.heuristic_cfg(nsa.invocation(q, k, v, None, None, indices, 3, None, None, "triton")).platform == "triton"
    with pytest.raises(ValueError, match="platform must be one of xla, triton, pallas"):
        nsa(q, k, v, None, None, indices, 3, None, None, "cuda")
    with pytest.raises(ValueError, match="available: pallas, xla"):
        nsa(q, k, v, None, None, indices, 3, cfg=Config(block_size=BLOCK, platform="triton", backend="tpu"))


# ---- one path for the function and the kernel ---------------------------------------------------


def test_kernel_and_function_are_one_path(rng):
    q, k, v, indices = inputs(rng)
    g_slc = gate(rng, 1, 40, 4)
    cfg = Config(block_size=BLOCK)
    by_function = nsa_dsl.native_sparse_attention(q, k, v, None, g_slc, indices, 2, cfg=cfg)
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    by_kernel = nsa(q, k, v, None, g_slc, indices, 2, cfg=cfg)
    by_run = nsa.run(q, k, v, None, g_slc, indices, 2, cfg=nsa.heuristic_cfg(nsa.invocation(q, k, v, None, g_slc, indices, 2)))
    by_default = nsa(q, k, v, None, g_slc, indices, 2)  # cfg chosen: the heuristic on a CPU
    np.testing.assert_array_equal(np.asarray(by_function), np.asarray(by_kernel))
    np.testing.assert_array_equal(np.asarray(by_function), np.asarray(by_run))
    np.testing.assert_array_equal(np.asarray(by_function), np.asarray(by_default))
    for bad in (42, Config, "fastest"):
        with pytest.raises(ValueError, match=r"cfg must be a NativeSparseAttentionConfig \(nsa_dsl's or ejkernel's\), "
                           "'autotune', 'heuristic' or None"):
            nsa_dsl.native_sparse_attention(q, k, v, None, g_slc, indices, 2, cfg=bad)


@dataclasses.dataclass(frozen=True)
class EjkernelConfig:
    """ejkernel 0.0.80's NativeSparseAttentionConfig, field for field (ejkernel is not a dependency)."""

    platform: str = "auto"
    backend: str = "any"
    block_q: int = 64
    block_k: int = 64
    block_d: int = 64
    block_size: int = 64
    num_warps: int = 4
    num_stages: int = 1


def test_ejkernels_configurations_run_unchanged(rng):
    """ejkernel's configuration object was refused ("cfg must be a NativeSparseAttentionConfig, ...,
    got NativeSparseAttentionConfig"): converted setting by setting, its block_size included."""
    q, k, v, indices = inputs(rng)
    g_slc = gate(rng, 1, 40, 4)
    theirs = EjkernelConfig(platform="xla", block_size=BLOCK, block_k=16)
    ours = Config(platform="xla", backend=None, block_q=64, block_k=16, block_d=64, block_size=BLOCK, num_warps=4,
                  num_stages=1)
    assert Config.of(theirs, "cfg", "or None") == ours
    expected = nsa_dsl.native_sparse_attention(q, k, v, None, g_slc, indices, 2, cfg=ours)
    np.testing.assert_array_equal(np.asarray(nsa_dsl.native_sparse_attention(q, k, v, None, g_slc, indices, 2, cfg=theirs)),
                                  np.asarray(expected))
    attention = nsa_dsl.compile("pattern p\nblock 16\nbranch main = window(20)\n", config=theirs)
    assert attention.config == Config.of(theirs, "config", "or None")
    with pytest.raises(ValueError, match="cfg.block_size must be a positive int"):  # its values are checked as ours
        nsa_dsl.native_sparse_attention(q, k, v, None, g_slc, indices, 2, cfg=EjkernelConfig(block_size=0))


def test_ignored_block_indices_are_reported_at_the_callers_line(rng):
    q, k, v, indices = inputs(rng, seq_len=32)
    g_cmp = gate(rng, 1, 32, 4)
    with pytest.warns(UserWarning, match="block_indices are ignored") as caught:  # traced only: no need to compile
        jax.eval_shape(lambda q: nsa_dsl.native_sparse_attention(q, k, v, g_cmp, None, indices, 1, cfg=Config(block_size=BLOCK)), q)
    assert Path(caught[0].filename) == Path(__file__)


# ---- configurations -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"block_k": 48}, "block_k must be a power of two"),
        ({"block_q": 96}, "block_q must be a power of two"),
        ({"num_warps": 3}, "num_warps must be a power of two"),
        ({"num_stages": 0}, "num_stages must be a positive int"),
        ({"chunk_bytes": -1}, "chunk_bytes must be a positive int"),
        ({"block_size": True}, "block_size must be a positive int"),
        ({"block_size": np.bool_(True)}, "block_size must be a positive int"),
        ({"block_size": 2**29 + 1}, "block_size must be a positive int up to 2\\*\\*29"),
        ({"block_k": np.int64(48)}, "block_k must be a power of two"),
        ({"platform": "cuda"}, "platform must be one of"),
        ({"backend": "npu"}, "backend must be"),
    ],
)
def test_illegal_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        Config(**settings)


def test_numpy_integers_are_settings_as_python_ints():
    """Sizes computed with numpy (np.int64) were refused as "must be a positive int"."""
    settings = Config(block_size=np.int64(32), block_k=np.int32(64), num_stages=np.uint8(2))
    assert settings == Config(block_size=32, block_k=64, num_stages=2)
    assert all(type(getattr(settings, name)) is int for name in ("block_size", "block_k", "num_stages"))


def test_ejkernels_default_configuration_runs_unchanged(rng):
    """ejkernel's heuristic configuration (block_q = block_k = block_d = 64, 4 warps, 1 stage,
    platform "auto", backend "any") on a head dimension above its block_d: its head tile is read
    by no kernel here, so the call runs and computes what the default configuration does."""
    assert Config(backend="any").backend is None
    q, k, v, indices = inputs(rng, head_dim=24)
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    ejkernels = Config(block_q=64, block_k=64, block_d=8, block_size=BLOCK, num_warps=4, num_stages=1,
                       platform="auto", backend="any")
    expected = nsa(q, k, v, None, None, indices, 3, cfg=Config(block_size=BLOCK))
    np.testing.assert_array_equal(np.asarray(nsa(q, k, v, None, None, indices, 3, cfg=ejkernels)), np.asarray(expected))


# ---- candidates ---------------------------------------------------------------------------------


def test_candidates_per_platform(rng):
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    q, k, v, indices = inputs(rng)

    def invocation(platform):
        return nsa.invocation(q, k, v, None, None, indices, 3, None, None, platform)

    triton = nsa.candidate_cfgs_gpu(invocation("triton"))
    assert triton[0] == nsa.heuristic_cfg(invocation("triton"))
    grid = {(c.block_k, c.num_warps, c.num_stages) for c in triton[1:]}
    assert grid == {(t, w, s) for t in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)}
    pallas = nsa.candidate_cfgs_gpu(invocation("pallas"))
    assert {(c.block_q, c.num_warps, c.num_stages) for c in pallas[1:]} == {(None, w, s) for w in (4, 8) for s in (1, 2, 3)}
    # Pallas' compression and top-k kernels have query tiles (block_q); its selection kernels none.
    g_cmp = gate(rng, 1, 40, 4)
    topk = nsa.candidate_cfgs_gpu(nsa.invocation(q, k, v, g_cmp, None, None, 2, None, None, "pallas"))
    assert {(c.block_q, c.block_k) for c in topk[1:]} == {(t, None) for t in (32, 64, 128)} and len(topk) == 19
    # The Pallas kernels read no tile size yet: the TPU's 64/128 tiles are the heuristic all the same.
    assert nsa.candidate_cfgs_tpu(invocation("pallas")) == [nsa.heuristic_cfg(invocation("pallas"))]
    xla = nsa.candidate_cfgs_xla(invocation("xla"))
    chunks = {"xla": [None, 4 << 20, 64 << 20], "gpu": [None, 64 << 20, 256 << 20]}[DEVICE]  # a GPU's memory is larger
    assert [c.chunk_bytes for c in xla] == chunks and {c.platform for c in xla} == {"xla"}
    assert nsa.candidate_cfgs(invocation(None)) == {"xla": xla, "gpu": triton}[DEVICE]  # this machine's
    assert nsa.candidate_cfgs_xla(invocation("triton")) == [nsa.heuristic_cfg(invocation("triton"))]  # interpreted
    for cfg in triton + pallas + xla:
        assert cfg.block_size == BLOCK  # part of the result's meaning: never tuned

    # A selection block of 64 is one block a step at block_k 32 or 64: one candidate.
    wide = nsa_dsl.NativeSparseAttention(block_size=64)
    steps = {c.block_k for c in wide.candidate_cfgs_gpu(wide.invocation(q, k, v, None, None, indices, 3, None, None, "triton"))}
    assert steps == {None, 64, 128}


def test_shard_map_candidates_are_chosen_for_the_shards_shapes(rng, monkeypatch):
    calls = []
    name = f"candidate_cfgs_shard_map_{DEVICE}"
    shard_candidates = getattr(nsa_dsl.NativeSparseAttention, name)

    def recording(self, inv):
        calls.append(inv.arguments["query"].shape)
        return shard_candidates(self, inv)

    monkeypatch.setattr(nsa_dsl.NativeSparseAttention, name, recording)
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    q, k, v, indices = inputs(rng)
    shard = nsa.invocation(q[:, :, :2], k[:, :, :1], v[:, :, :1], None, None, indices[:, :, :1], 3, method="shard_map")
    assert nsa.candidate_cfgs(shard) == getattr(nsa, f"candidate_cfgs_{DEVICE}")(shard)
    assert calls == [(1, 40, 2, 16)]


def test_every_setting_reaches_the_generated_kernels(rng):
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    q, k, v, indices = inputs(rng)
    plan = kernel.selection_plan(BLOCK)
    for platform in ("triton", "pallas"):
        for cfg in nsa.candidate_cfgs_gpu(nsa.invocation(q, k, v, None, None, indices, 3, None, None, platform)):
            source = codegen.source(platform, plan, cfg)
            if platform == "triton":
                assert f"STEP_KEYS = {cfg.block_k or 128}  #" in source
                assert f"NUM_WARPS = {cfg.num_warps}\n" in source and f"NUM_STAGES = {cfg.num_stages}\n" in source
            else:
                assert f"num_warps={cfg.num_warps}," in source and f"num_stages={cfg.num_stages}," in source
    topk = nsa.invocation(q, k, v, gate(rng, 1, 40, 4), None, None, 2, None, None, "pallas")
    for cfg in nsa.candidate_cfgs_gpu(topk):
        assert f"TILE_ROWS = {cfg.block_q or 128}\n" in codegen.source("pallas", nsa.plan_for(topk), cfg)
    for cfg in nsa.candidate_cfgs_xla(nsa.invocation(q, k, v, None, None, indices, 3)):
        source = codegen.source("xla", plan, cfg)
        assert f"CHUNK_BYTES = {cfg.chunk_bytes or '16 * 2**20'}\n" in source


def _distinct_interpreted(cfgs):
    """Triton's interpreter ignores num_warps and num_stages: candidates differing only there
    compute the same thing on a CPU (test_every_candidate_gives_the_xla_result_on_a_gpu runs
    them all on a GPU)."""
    return list({dataclasses.replace(c, num_warps=None, num_stages=None): c for c in cfgs}.values())


@pytest.mark.parametrize("platform", ["xla", "triton", "pallas"])
def test_every_candidate_gives_the_xla_result(rng, platform):
    """Tuning never changes the result. 9 entries per token make the Triton step sizes (2, 4 and
    8 blocks a step) all differ; T=37 and D=12 are not multiples of anything; GQA group 3."""
    nsa = nsa_dsl.NativeSparseAttention(block_size=BLOCK)
    q, k, v, indices = inputs(rng, seq_len=37, heads_q=3, heads_kv=1, head_dim=12, width=9)
    g_slc = gate(rng, 1, 37, 3)
    inv = nsa.invocation(q, k, v, None, g_slc, indices, 9, None, None, platform)
    expected = nsa(q, k, v, None, g_slc, indices, 9, cfg=nsa.reference_cfg(inv))
    if platform == "xla":
        candidates = nsa.candidate_cfgs_xla(inv)
    else:
        candidates = nsa.candidate_cfgs_gpu(inv)
        candidates = _distinct_interpreted(candidates) if platform == "triton" else candidates
    assert len(candidates) == {"xla": 3, "triton": 4, "pallas": 7}[platform]
    for cfg in candidates:
        out = nsa(q, k, v, None, g_slc, indices, 9, None, None, platform, cfg=cfg)
        assert_close(out, expected, FORWARD_TOLERANCE, f"{cfg}")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: every GPU candidate compiled for real")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_candidate_gives_the_xla_result_on_a_gpu(rng, dtype):
    nsa = nsa_dsl.NativeSparseAttention(block_size=64)
    q, k, v = (jnp.asarray(x, dtype) for x in qkv(rng, 1, 1000, 16, 2, 128))
    indices = random_indices(rng, 1, 1000, 2, 16, 64)
    inv = nsa.invocation(q, k, v, None, None, indices, 16)
    expected = np.asarray(nsa(q, k, v, None, None, indices, 16, cfg=nsa.reference_cfg(inv)), np.float64)
    for platform in ("triton", "pallas"):
        for cfg in nsa.candidate_cfgs_gpu(nsa.invocation(q, k, v, None, None, indices, 16, None, None, platform)):
            out = nsa(q, k, v, None, None, indices, 16, None, None, platform, cfg=cfg)
            assert_close(out, expected, nsa.tolerance(dtype), f"{cfg}")


def test_a_top_k_count_as_an_integer_scalar_array_in_every_entry(rng):
    """native_sparse_attention, the Kernel interface and its shard_map entry take a concrete
    integer scalar array as the top-k's count alike (only the first did)."""
    from nsa_dsl.sharding import sharded_native_sparse_attention

    q, k, v = qkv(rng, 1, 40, 4, 2, 8)
    g_cmp, g_slc = gate(rng, 1, 40, 4), gate(rng, 1, 40, 4)
    want = np.asarray(nsa_dsl.native_sparse_attention(q, k, v, g_cmp, g_slc, None, 2, cfg=Config(block_size=16)))
    mesh = jax.make_mesh((1,), ("data",))
    entries = (nsa_dsl.NativeSparseAttention(16), sharded_native_sparse_attention(mesh, batch_axis="data", block_size=16))
    for entry in entries:
        got = entry(q, k, v, g_cmp, g_slc, None, jnp.int32(2), cfg="heuristic")
        np.testing.assert_array_equal(np.asarray(got), want)
