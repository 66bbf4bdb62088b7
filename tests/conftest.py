"""Shared helpers: fresh random inputs, error measures, a private code-generation cache."""

from __future__ import annotations

import contextlib
import os
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

from nsa_dsl.plan import plan as p

# XLA:CPU compiles each test's programs once and runs them on tiny shapes: without its optimising
# passes it compiles them in a fraction of the time (tests/test_xla_*.py: 72 s against ~150), and the
# results still meet the tolerances against float64. Set before jax starts its backend; processes the
# tests start inherit them; flags already in XLA_FLAGS come later and win.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Compiler options for a test that inspects a compiled program: its HLO as a user's compilation makes
# it (without fusion emitters XLA:CPU lowers a scatter to a while loop).
AS_USERS_COMPILE: dict = {}
if jax.__version_info__ < (0, 11):  # jaxlib 0.11 aborts on this flag (removed)
    _FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false"
    AS_USERS_COMPILE["xla_cpu_use_fusion_emitters"] = True
os.environ["XLA_FLAGS"] = f"{_FAST_COMPILE} {os.environ.get('XLA_FLAGS', '')}".strip()

CHECKOUT = Path(__file__).resolve().parents[1]


def child_env(**variables: str) -> dict[str, str]:
    """The environment of a new interpreter that imports this checkout's nsa_dsl: this one's, the
    checkout first on PYTHONPATH and the entries already there after it (the GPU machine's packages
    live on PYTHONPATH), with `variables` set."""
    paths = [str(CHECKOUT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **variables}


# float32 kernels against the float64 reference: accumulation error only.
FORWARD_TOLERANCE = 2e-5
GRADIENT_TOLERANCE = 1e-4
BF16_TOLERANCE = 2e-2


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory):
    """Generated modules go to a per-session folder, not the user's ~/.cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("NSA_DSL_CACHE_DIR", str(tmp_path_factory.mktemp("nsa_cache")))
    yield
    patch.undo()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded from the test's id: fresh data per test, reproducible per run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def normal(rng: np.random.Generator, *shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def qkv(rng: np.random.Generator, batch: int, seq_len: int, heads_q: int, heads_kv: int, head_dim: int, dtype=np.float32):
    return (
        normal(rng, batch, seq_len, heads_q, head_dim, dtype=dtype),
        normal(rng, batch, seq_len, heads_kv, head_dim, dtype=dtype),
        normal(rng, batch, seq_len, heads_kv, head_dim, dtype=dtype),
    )


def gate(rng: np.random.Generator, batch: int, seq_len: int, heads_q: int) -> np.ndarray:
    return rng.uniform(0.25, 1.5, (batch, seq_len, heads_q)).astype(np.float32)


def random_indices(rng, batch, seq_len, heads_kv, width, block, cu_seqlens=None):
    """Block ids mostly in range for each token's own sequence, some negative or past it, and
    repeats (drawn from a small range)."""
    first = np.zeros(seq_len, dtype=np.int64)
    if cu_seqlens is not None:
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            first[start:end] = start
    pos = np.arange(seq_len) - first
    own = rng.integers(0, pos // block + 1, (batch, heads_kv, width, seq_len)).transpose(0, 3, 1, 2)
    noise = rng.integers(-3, seq_len // block + 3, own.shape)
    return np.where(rng.random(own.shape) < 0.8, own, noise).astype(np.int32)


def mask_value(expr: p.MaskExpr, q_pos, k_pos, atom_bits) -> np.ndarray:
    """The token mask IR (nsa_dsl/plan/plan.py) in numpy, as a kernel evaluates it on a tile;
    arguments broadcast against each other."""
    shape = np.broadcast_shapes(np.shape(q_pos), np.shape(k_pos), np.shape(atom_bits))
    match expr:
        case p.TokenWindow(left, right):
            return np.broadcast_to((k_pos > q_pos - left) & (k_pos <= q_pos + right), shape)
        case p.AtomBit(index):
            return np.broadcast_to((np.asarray(atom_bits) >> index) & 1 == 1, shape)
        case p.AnyOf(parts):
            return np.logical_or.reduce([mask_value(x, q_pos, k_pos, atom_bits) for x in parts])
        case p.AllOf(parts):
            return np.logical_and.reduce([mask_value(x, q_pos, k_pos, atom_bits) for x in parts])
        case p.Without(left, right):
            return mask_value(left, q_pos, k_pos, atom_bits) & ~mask_value(right, q_pos, k_pos, atom_bits)
    raise TypeError(expr)


def lower_for_cuda(jitted, *args):
    """A jit function traced with `args` and lowered for CUDA on this host, which has no GPU.
    jax 0.11's Pallas reads the target GPU from the abstract mesh's device when it traces (an
    H200's here; jax 0.10 asks for no device)."""
    target = jax.sharding.AbstractDevice("NVIDIA H200", None, "gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("lowering",), abstract_device=target)):
        return jitted.trace(*args).lower(lowering_platforms=("cuda",))


@pytest.fixture
def mosaic_gpu_interpreter(monkeypatch):
    """A context manager under which the Mosaic GPU kernels traced run on the CPU in Mosaic GPU's
    interpreter, with its race detector: it simulates the warpgroups, their barriers and TMA copies
    (the generic and the async proxies apart), and it rejects a barrier left with completed phases
    its waiters never saw. A race it reports (logged) fails the test. Persistent kernels get 2 CTAs.
    The kernels run on the CPU device even where a GPU is the default: there the interpreter's
    callbacks went to the GPU and three small kernels ran past 500 s (sessions 46 and 78), where
    the CPU takes 26 s. jax 0.10's interpreter fails on plgpu.load (an assertion in its abstract
    evaluation), so the fixture skips there; jax 0.11 runs it."""
    pytest.importorskip("absl")  # Mosaic GPU's lowering logs through absl
    if jax.__version_info__ < (0, 11):
        pytest.skip("Mosaic GPU's interpreter runs these kernels from jax 0.11 on")
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as interpreter
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from nsa_dsl.runtime import triton_glue

    monkeypatch.setattr(triton_glue, "multiprocessors", lambda: 2)
    interpreter.reset_gpu_interpret_mode_state()

    @contextlib.contextmanager
    def interpreted():
        with (jax.default_device(jax.devices("cpu")[0]),
              plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True))):
            yield
        assert not interpreter.get_races().races_found, "Mosaic GPU's interpreter found a race (logged above)"

    yield interpreted
    interpreter.reset_gpu_interpret_mode_state()


@pytest.fixture
def recomputed_scores(monkeypatch):
    """The Triton selection backward's other order: no memory for the score gradients, so dq
    recomputes them."""
    from nsa_dsl.runtime import triton_glue

    monkeypatch.setattr(triton_glue, "fits_device_memory", lambda nbytes, share: False)
    jax.clear_caches()  # traces that chose to store them
    yield
    jax.clear_caches()


@pytest.fixture
def scores_in_head_slices(monkeypatch):
    """Memory for the score gradients of half the KV heads at a time: the backward stores and
    reads them in two slices of heads."""
    from nsa_dsl.runtime import triton_glue

    asked = []

    def fits(nbytes, share):
        asked.append(nbytes)
        return 2 * nbytes <= asked[0]  # asked[0]: every KV head's

    monkeypatch.setattr(triton_glue, "fits_device_memory", fits)
    jax.clear_caches()
    yield asked
    jax.clear_caches()


@pytest.fixture
def block_outer_forward(monkeypatch):
    """Every per-token selection's forward runs key block by key block (BLOCK_OUTER_PAIRS = 0), its
    pair lists in segments of 16 rows (several a list)."""
    from nsa_dsl import codegen
    from nsa_dsl.runtime import dispatch

    load = codegen.load_module

    def loading(platform, plan, config=None):
        module = load(platform, plan, config)
        if platform == "triton":
            monkeypatch.setattr(module, "BLOCK_OUTER_PAIRS", 0)
            monkeypatch.setattr(module, "SEGMENT_ROWS", 16)
        return module

    monkeypatch.setattr(codegen, "load_module", loading)
    dispatch.generated_module.cache_clear()
    dispatch.kernel.cache_clear()
    jax.clear_caches()
    yield
    dispatch.generated_module.cache_clear()  # nor a module holding them
    dispatch.kernel.cache_clear()  # no later test may reuse a kernel traced with these constants
    jax.clear_caches()


def triton_launches(monkeypatch, run) -> list[tuple[str, tuple]]:
    """(kernel name, grid) of the Triton launches `run()` makes, in order: while jax traces them,
    the launches a jitted program will make."""
    from nsa_dsl.runtime import triton_glue

    launches = []
    launch = triton_glue.launch

    def recording(kernel, grid, *args, **kwargs):
        launches.append((kernel.__name__, tuple(grid)))
        return launch(kernel, grid, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(triton_glue, "launch", recording)
        run()
    return launches


def record_calls(monkeypatch, module, *names) -> list[str]:
    """Wrap the functions `names` of a generated module so that each call appends its name to the
    list returned (which Hopper kernels ran)."""
    calls = []

    def record(name):
        function = getattr(module, name)

        def recorded(*args):
            calls.append(name)
            return function(*args)

        monkeypatch.setattr(module, name, recorded)

    for name in names:
        record(name)
    return calls


def launched_triton_kernels(monkeypatch, run) -> list[str]:
    """The Triton kernels (by name) that `run()` launches, in order (triton_launches)."""
    return [name for name, _ in triton_launches(monkeypatch, run)]


# A gradient that should vanish (a query that sees one key has dq = 0) is judged by its rounding
# against VANISHING times the largest gradient of the call (gradient_floor): that rounding grows
# with the others (~1e-6 at head dim 32; ~4e-6 where dv reaches 13 at head dim 192).
VANISHING = 0.1


def gradient_floor(*gradients) -> float:
    """assert_close's `least` for the gradients of one call: VANISHING times the largest of them
    (and at least VANISHING)."""
    return VANISHING * max(1.0, *(float(np.abs(np.asarray(g)).max(initial=0.0)) for g in gradients))


def relative_error(actual, expected, least: float = 1e-30) -> float:
    """max |actual - expected| / max |expected| (or `least`, where that is larger)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.isfinite(actual).all(), "non-finite values"
    return float(np.abs(actual - expected).max(initial=0.0) / max(np.abs(expected).max(initial=0.0), least))


def assert_close(actual, expected, tolerance: float, what: str = "", least: float = 1e-30) -> None:
    error = relative_error(actual, expected, least)
    assert error <= tolerance, f"{what}: relative error {error:.3e} > {tolerance:.1e}"


def assert_scale_gradient_close(actual, expected, q, d_q, scale, tolerance: float) -> None:
    """d loss / d softmax_scale against the reference's `expected`. The kernels return sum(q . dq) /
    scale summed over dq stored in q's dtype (layout.scale_gradients), and that sum cancels (its
    terms' magnitudes add up to ~30x the total at these shapes): besides `tolerance` relative to the
    value it may err by what storing dq rounds away, the dtype's unit roundoff times
    sum |q . d_q| / |scale| (d_q: the reference's). Where every d_q vanishes (each query sees one
    key) the sum is the kernels' rounding alone, with nothing to judge it against: not compared."""
    if not np.any(d_q):
        return
    q = np.asarray(q)
    roundoff = float(jax.numpy.finfo(q.dtype).eps) / 2  # jax.numpy: bfloat16 too
    floor = roundoff * float(np.sum(np.abs(q.astype(np.float64) * np.asarray(d_q, np.float64)))) / abs(float(scale))
    allowed = tolerance * abs(float(expected)) + floor
    error = abs(float(actual) - float(expected))
    assert error <= allowed, (f"d softmax_scale: {float(actual):.6g} against {float(expected):.6g}, "
                              f"error {error:.3e} > {allowed:.3e}")


def check_selection_against_reference(rng, attention, q, k, v, g_slc, indices, counts, block, cu_seqlens, tolerances,
                                      scale=None):
    """Forward and the gradients of q, k, v and the gate of an explicit-selection `attention`
    (called as attention(q, k, v, g_slc, indices, counts, block, cu_seqlens)) against the
    float64 reference; tolerances = (forward, gradients); outputs and gradients keep q's dtype.
    scale: the softmax scale `attention` applies (None: its default, 1 / sqrt(head_dim))."""
    import jax.numpy as jnp

    import reference

    forward_tolerance, gradient_tolerance = tolerances
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    mask = reference.selection_mask(indices, counts, block, cu_seqlens)
    d_out = normal(rng, *q.shape).astype(q.dtype)
    out, pullback = jax.vjp(lambda *a: attention(*a, indices, counts, block, cu_seqlens), q, k, v, g_slc)
    assert out.dtype == q.dtype and out.shape == q.shape
    expected = reference.forward(q, k, v, [mask], [g_slc], scale)
    assert_close(out, expected, forward_tolerance, "output")
    # Not differentiated, a backend may run another forward (Triton's gates the output in the kernel).
    undifferentiated = attention(q, k, v, g_slc, indices, counts, block, cu_seqlens)
    assert_close(undifferentiated, expected, forward_tolerance, "output, not differentiated")

    dq, dk, dv, dg = pullback(jnp.asarray(d_out))
    expected = reference.gradients(q, k, v, [mask], [g_slc], scale, d_out)
    for name, actual, wanted in (
        ("dq", dq, expected["q"]),
        ("dk", dk, expected["k"]),
        ("dv", dv, expected["v"]),
        ("dg_slc", dg, expected["gates"][0]),
    ):
        assert actual.dtype == q.dtype
        assert_close(actual, wanted, gradient_tolerance, name)

