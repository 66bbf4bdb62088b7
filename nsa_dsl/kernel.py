"""ejkernel's Kernel interface: an operation, the configurations it runs with, its
implementations registered per (platform, backend), and autotuning.

    kernel = nsa_dsl.NativeSparseAttention()                 # block_size=64, as ejkernel's
    out = kernel(q, k, v, None, g_slc, block_indices, 16)     # cfg: the tuned entry or the heuristic
    out = kernel(q, k, v, None, g_slc, block_indices, 16, cfg="autotune")
    inv = kernel.invocation(q, k, v, None, g_slc, block_indices, 16)
    cfg = kernel.autotune(inv)                                # times kernel.candidate_cfgs(inv)
    out = kernel(q, k, v, None, g_slc, block_indices, 16, cfg=cfg)   # a configuration is used as given

`nsa_dsl.native_sparse_attention` is a call of NativeSparseAttention(); nsa_dsl.autotune holds
the timing, the on-disk entries and the NSA_DSL_AUTOTUNE policy.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from . import autotune as tuning
from .codegen.render import plan_literal, template_texts
from .config import BACKENDS, NativeSparseAttentionConfig
from .dsl import model
from .plan import lower_keys
from .plan import plan as p
from .runtime import attend, choose_platform, resolve_platform, validate
from .runtime.triton_glue import next_power_of_two
from .sharding import following_placement

Cfg = TypeVar("Cfg")
Out = TypeVar("Out")

__all__ = [
    "SETTINGS_READ",
    "TILES_READ",
    "Invocation",
    "Kernel",
    "NativeSparseAttention",
    "abstract",
    "compressed_selection_plan",
    "implementation",
    "register",
    "selection_plan",
    "settings_read",
]


# ---- invocations ----------------------------------------------------------------------------


def _is_array(value: object) -> bool:
    """Arrays, tracers and jax.ShapeDtypeStruct: what has a shape and a dtype (not numpy scalars)."""
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.generic)


def _is_concrete(value: object) -> bool:
    """Values at hand: numpy arrays, lists and jax arrays that are not tracers."""
    return isinstance(value, (np.ndarray, list, tuple)) or (isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer))


def abstract(name: str, value: object) -> object:
    """What a configuration may depend on of argument `name`, as JSON: an array's shape (concrete
    sizes) and dtype; an int, bool, string or None itself; of a float only that it is one (a
    softmax scale changes numbers, not code)."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return "float"
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if _is_array(value):
        return {"shape": list(validate.concrete_shape(name, value.shape)), "dtype": str(np.dtype(value.dtype))}
    return {"type": type(value).__name__}


@dataclasses.dataclass(frozen=True, eq=False)
class Invocation(Generic[Cfg, Out]):
    """One call of a kernel: `arguments`, the kernel's `run` parameters by name with defaults
    filled in (arrays may be tracers or jax.ShapeDtypeStruct: only their shapes and dtypes are
    read), the kernel's `static` settings, and `method` "shard_map" when the arguments are one
    shard's. `signature` is its abstract form and `key` a stable hash of it."""

    op_id: str
    arguments: Mapping[str, Any]
    static: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    method: str | None = None

    def __post_init__(self) -> None:
        if self.method not in (None, "shard_map"):
            raise ValueError(f"method must be None or 'shard_map', got {self.method!r}")
        object.__setattr__(self, "arguments", MappingProxyType(dict(self.arguments)))
        object.__setattr__(self, "static", MappingProxyType(dict(self.static)))

    @property
    def args(self) -> tuple:
        return tuple(self.arguments.values())

    @functools.cached_property
    def signature(self) -> dict:
        return {
            "op": self.op_id,
            "method": self.method,
            "arguments": {name: abstract(name, value) for name, value in self.arguments.items()},
            "static": {name: abstract(name, value) for name, value in self.static.items()},
        }

    @functools.cached_property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.signature, sort_keys=True).encode()).hexdigest()


# ---- the registry of implementations ----------------------------------------------------------

_IMPLEMENTATIONS: dict[tuple[str, str, str], Callable] = {}


def register(op_id: str, platform: str, backend: str, impl: Callable) -> None:
    """Make `impl` op_id's implementation on `platform` for `backend` devices ("gpu", "tpu",
    "cpu", or "any": every device the platform runs on)."""
    if backend not in BACKENDS + ("any",):
        raise ValueError(f"backend must be one of {BACKENDS + ('any',)}, got {backend!r}")
    _IMPLEMENTATIONS[(op_id, platform, backend)] = impl


def implementation(op_id: str, platform: str, backend: str) -> Callable:
    """The implementation registered for (op_id, platform, backend), else for (op_id, platform,
    "any"); ValueError naming the registered ones when there is none."""
    for key in ((op_id, platform, backend), (op_id, platform, "any")):
        if key in _IMPLEMENTATIONS:
            return _IMPLEMENTATIONS[key]
    available = ", ".join(f"{pl} on {be}" for op, pl, be in sorted(_IMPLEMENTATIONS) if op == op_id)
    raise ValueError(f"{op_id} has no implementation for platform={platform!r} on backend={backend!r}; "
                     f"available: {available or 'none'}")


# ---- kernels --------------------------------------------------------------------------------


class Kernel(Generic[Cfg, Out]):
    """An operation with configurations (ejkernel's Kernel).

    Subclasses define `run(..., *, cfg)` and `heuristic_cfg(inv)`, and for autotuning the
    candidate_cfgs_* methods and the tuning hooks below. Calling a kernel chooses the
    configuration (choose_cfg) and runs it.
    """

    op_id: str
    version: str = "1"  # part of tuned entries' keys: raise it when the candidates' meaning changes
    config_type: type  # its configurations' class; config_type.of(value) converts another library's

    def run(self, *args, cfg: Cfg, **kwargs) -> Out:
        raise NotImplementedError

    def heuristic_cfg(self, inv: Invocation) -> Cfg:
        """A configuration that is always correct and fast enough: no measurement needed."""
        raise NotImplementedError

    # -- candidates: what autotuning times ------------------------------------------------------

    def candidate_cfgs(self, inv: Invocation) -> list[Cfg]:
        """The candidates for jax's device (candidate_cfgs_gpu, _tpu, or _xla elsewhere), the
        shard_map variants when `inv` holds one shard's arguments; repeats dropped."""
        device = {"gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "xla")
        context = "shard_map_" if inv.method == "shard_map" else ""
        return list(dict.fromkeys(getattr(self, f"candidate_cfgs_{context}{device}")(inv)))

    def candidate_cfgs_gpu(self, inv: Invocation) -> list[Cfg]:
        return [self.heuristic_cfg(inv)]

    def candidate_cfgs_tpu(self, inv: Invocation) -> list[Cfg]:
        return [self.heuristic_cfg(inv)]

    def candidate_cfgs_xla(self, inv: Invocation) -> list[Cfg]:
        return [self.heuristic_cfg(inv)]

    def candidate_cfgs_shard_map_gpu(self, inv: Invocation) -> list[Cfg]:
        """Candidates for one shard's arguments (inv.method == "shard_map")."""
        return self.candidate_cfgs_gpu(inv)

    def candidate_cfgs_shard_map_tpu(self, inv: Invocation) -> list[Cfg]:
        return self.candidate_cfgs_tpu(inv)

    def candidate_cfgs_shard_map_xla(self, inv: Invocation) -> list[Cfg]:
        return self.candidate_cfgs_xla(inv)

    # -- implementations --------------------------------------------------------------------

    def get_impl(self, cfg: Cfg) -> Callable:
        """The registered implementation for cfg's platform (resolved when None or "auto") on
        cfg's backend (jax's device when None)."""
        platform = resolve_platform(None, cfg)
        return implementation(self.op_id, platform, getattr(cfg, "backend", None) or jax.default_backend())

    # -- calling ------------------------------------------------------------------------------

    def static_settings(self) -> Mapping[str, Any]:
        """Settings of this kernel object that shape its invocations (part of their keys)."""
        return {}

    def invocation(self, *args, method: str | None = None, **kwargs) -> Invocation:
        """The invocation of run(*args, **kwargs); method="shard_map" for one shard's arguments."""
        bound = inspect.signature(self.run).bind(*args, cfg=None, **kwargs)
        bound.apply_defaults()
        arguments = {name: value for name, value in bound.arguments.items() if name != "cfg"}
        return Invocation(self.op_id, arguments, self.static_settings(), method)

    def __call__(self, *args, cfg: Cfg | str | None = None, **kwargs) -> Out:
        """run(*args, **kwargs) with `cfg`: a configuration (used as given, never stored; another
        library's with the same settings is converted), "autotune", "heuristic" or None (see choose_cfg)."""
        if cfg is None or isinstance(cfg, str):
            cfg = self.choose_cfg(self.invocation(*args, **kwargs), cfg)
        else:
            cfg = self.config_type.of(cfg, "cfg", "'autotune', 'heuristic' or None")
        return self.run(*args, **kwargs, cfg=cfg)

    def choose_cfg(self, inv: Invocation, requested: str | None = None) -> Cfg:
        """The configuration of a call that did not pass one. "heuristic", or NSA_DSL_AUTOTUNE=0:
        heuristic_cfg. Otherwise the tuned entry of this invocation on this device if there is
        one; if not, tuning now for "autotune", for NSA_DSL_AUTOTUNE=1, or when tunes_lazily(inv)
        (None, the default), else heuristic_cfg."""
        if requested not in (None, "autotune", "heuristic"):
            raise ValueError(f"cfg must be a {self.config_type.__name__} (nsa_dsl's or ejkernel's), 'autotune', "
                             f"'heuristic' or None, got {requested!r}")
        policy = tuning.policy()
        if requested == "heuristic" or policy == "off":
            return self.heuristic_cfg(inv)
        tuned = tuning.lookup(self, inv)
        if tuned is not None:
            return tuned
        if requested == "autotune" or policy == "on" or self.tunes_lazily(inv):
            return tuning.tune(self, inv)
        return self.heuristic_cfg(inv)

    def autotune(self, inv: Invocation, *, candidates: Iterable[Cfg] | None = None, force: bool = False,
                 repeats: int | None = None, progress: bool = True) -> Cfg:
        """The tuned configuration of `inv` on this device: the stored entry unless `force`,
        else time `candidates` (default candidate_cfgs(inv)), store the fastest correct one and
        return it. A progress bar goes to stderr unless progress=False."""
        if not force:
            tuned = tuning.lookup(self, inv)
            if tuned is not None:
                return tuned
        return tuning.tune(self, inv, candidates=candidates, repeats=repeats, progress=progress)

    # -- tuning hooks -------------------------------------------------------------------------

    def tunes_lazily(self, inv: Invocation) -> bool:
        """Whether a call without a configuration tunes a new invocation by default."""
        return False

    def fingerprint(self, inv: Invocation) -> str:
        """What the timings depend on besides shapes, device and versions (the code that runs)."""
        return ""

    def reference_cfg(self, inv: Invocation) -> Cfg:
        """The configuration whose result candidates must reproduce."""
        return self.heuristic_cfg(inv)

    def admits(self, inv: Invocation, cfg: Cfg) -> bool:
        """Whether a stored tuned `cfg` may serve `inv`: tuning stores only configurations that
        reproduce reference_cfg's result, so one whose settings change the result (an entry edited
        by hand, or copied from elsewhere with its checksum) is not one it stored."""
        return True

    def check_invocation(self, inv: Invocation) -> None:
        """Raise run's error for arguments it would refuse: tracing run on their shapes and
        dtypes, with the values of concrete integer arrays (indices and offsets, whose values
        it checks too)."""
        def by_value(v):
            return not _is_array(v) or (_is_concrete(v) and not jnp.issubdtype(v.dtype, jnp.floating))

        arrays = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in inv.arguments.items() if not by_value(v)}
        values = {n: v for n, v in inv.arguments.items() if by_value(v)}
        cfg = self.heuristic_cfg(inv)
        jax.eval_shape(lambda arrays: self.run(**values, **arrays, cfg=cfg), arrays)

    def tuning_arguments(self, inv: Invocation, rng: np.random.Generator) -> dict[str, Any]:
        """Concrete random arguments of the invocation's shapes and dtypes (never zeros)."""
        out = {}
        for name, value in inv.arguments.items():
            if _is_array(value) and not jnp.issubdtype(value.dtype, jnp.floating):
                raise NotImplementedError(f"{type(self).__name__}.tuning_arguments: no rule for the integer argument {name}")
            out[name] = jnp.asarray(rng.standard_normal(value.shape), value.dtype) if _is_array(value) else value
        return out

    def check_slice(self, inv: Invocation, arguments: Mapping[str, Any]) -> tuple[dict, Callable]:
        """(arguments of a small call, the part of the full call's output it computes): the
        reference runs the small call and candidates must reproduce that part."""
        return dict(arguments), lambda out: out

    def tolerance(self, dtype) -> float:
        """Largest relative difference from the reference that a correct candidate shows."""
        return {"float16": 1e-2, "bfloat16": 4e-2, "float64": 1e-8}.get(np.dtype(dtype).name, 5e-3)


# ---- Native Sparse Attention ----------------------------------------------------------------


@functools.cache
def selection_plan(block_size: int) -> p.Plan:
    """The built-in plan of `native_sparse_attention` with explicit indices: one causal branch
    reading the caller's `block_indices`, gated by g_slc (weight 1 when not given)."""
    branch = p.SelectBranch(name="slc", gate=model.Gate("g_slc", 1.0), block=block_size)
    return p.Plan(name="native_sparse_attention", block_size=block_size, causal=True, params=(), branches=(branch,))


@functools.cache
def compressed_selection_plan(block_size: int, count: int) -> p.Plan:
    """The built-in plan of `native_sparse_attention` with g_cmp: mean-pooled compression over
    blocks of `block_size` (gated by g_cmp) scoring a per-token top-`count` selection of blocks
    of `block_size` that always holds the query's own block (gated by g_slc, weight 1 when not
    given) -- ejkernel's and flash-linear-attention's configuration."""
    compress = p.CompressBranch(name="cmp", gate=model.Gate("g_cmp"), block=block_size, stride=block_size, pool="mean")
    select = p.TopKBranch(
        name="slc", gate=model.Gate("g_slc", 1.0), count=count, block=block_size, score="cmp", query_block=1,
        force=lower_keys(model.Local(1)),
    )
    return p.Plan(name="native_sparse_attention", block_size=block_size, causal=True, params=(), branches=(compress, select))


def nsa_plan(block_size: int, g_cmp, block_indices, block_counts) -> p.Plan:
    """The plan a native_sparse_attention call runs: top-k over compressed scores when g_cmp is
    given (block_counts is then the count), else the caller's block_indices."""
    if g_cmp is not None:
        count = _concrete_int(block_counts)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
            raise ValueError(f"block_counts: with g_cmp it is the number of blocks top-k selects, a positive int; got {block_counts!r}")
        # Any count past a row's blocks selects them all; the kernels hold counts in int32, where
        # 2**31 and more would wrap negative, so such counts are the largest int32 (the language's limit).
        return compressed_selection_plan(block_size, min(int(count), np.iinfo(np.int32).max))
    if block_indices is None:
        raise ValueError("block_indices is required when g_cmp is None: pass [B, T, HKV, S] key-block ids")
    return selection_plan(block_size)


def _concrete_int(value):
    """A concrete integer scalar array (jnp.int32(16), np.int64(16)) as the int it holds, so that
    it sizes the top-k like one; anything else as it is (nsa_plan refuses what is no count)."""
    concrete = isinstance(value, (jax.Array, np.ndarray, np.generic)) and not isinstance(value, jax.core.Tracer)
    if concrete and value.ndim == 0 and np.issubdtype(value.dtype, np.integer):
        return int(value)
    return value


# What the generated kernels read of a configuration (templates/<platform>): settings every
# kernel of a platform reads, and the tile sizes of the kernels of each branch kind. Candidates
# that differ only in settings nothing reads are one candidate. Template changes update these.
SETTINGS_READ = {
    "triton": ("num_warps", "num_stages"),
    "pallas": ("num_warps", "num_stages"),  # its Triton lowering on a GPU
    "xla": ("chunk_bytes",),
}
TILES_READ = {
    ("triton", p.StaticBranch): ("block_q", "block_k"),  # STATIC_TILES
    ("triton", p.SelectBranch): ("block_k",),  # STEP_KEYS
    ("triton", p.CompressBranch): ("block_k",),
    ("triton", p.TopKBranch): ("block_k",),
    ("pallas", p.StaticBranch): ("block_q",),  # TILE_ROWS
    ("pallas", p.CompressBranch): ("block_q",),
    ("pallas", p.TopKBranch): ("block_q",),
}
_SPEED_SETTINGS = ("block_q", "block_k", "block_d", "num_warps", "num_stages", "chunk_bytes")


def settings_read(platform: str, plan: p.Plan, device: str) -> tuple[str, ...]:
    """The settings of a configuration that `platform`'s kernels for `plan` read on `device`."""
    if platform == "pallas" and device == "tpu":
        return ()  # the TPU kernels (templates/pallas/tpu_*.j2) take no setting yet
    tiles = (name for branch in plan.branches for name in TILES_READ.get((platform, type(branch)), ()))
    return tuple(dict.fromkeys((*tiles, *SETTINGS_READ[platform])))


# In the order they are tried: the most pipelined first, since the tuner's time limit may stop a
# sweep early and one stage was the slowest setting measured (H200, 2026-11-29).
GPU_TILES = (32, 64, 128)
GPU_WARPS = (4, 8)
GPU_STAGES = (3, 2, 1)
TPU_TILES = (64, 128)
# Chunk sizes tried besides the XLA engine's default (16 MiB): smaller ones stay in a CPU's
# caches, larger ones give a GPU bigger batched products.
XLA_CHUNK_MIB = {"cpu": (4, 64), "gpu": (64, 256), "tpu": (64, 256)}
# Tokens of the first batch row on which candidates are checked against the XLA backend.
CHECK_TOKENS = 256


def _registered_impl(platform: str) -> Callable:
    return functools.partial(attend, platform=platform)


for _platform, _backends in (("xla", ("any",)), ("triton", ("gpu", "cpu")), ("pallas", ("gpu", "tpu", "cpu"))):
    for _backend in _backends:  # triton and pallas on "cpu": their interpreters (tests, small shapes)
        register("native_sparse_attention", _platform, _backend, _registered_impl(_platform))


@functools.lru_cache(maxsize=256)
def _platform(plan: p.Plan, requested: str | None, device: str) -> str:
    """The platform a call of `plan` runs on (looked up several times per call without a cfg)."""
    return choose_platform(plan, requested, NativeSparseAttentionConfig(block_size=plan.block_size, backend=device))


@functools.cache
def _templates_digest(platform: str) -> str:
    return hashlib.sha256(template_texts(platform).encode()).hexdigest()


def _warn_at_caller(message: str) -> None:
    """Warn at the first frame outside nsa_dsl (the user's call), however deep the call chain."""
    package = os.path.dirname(os.path.abspath(__file__))
    depth = 1
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, depth = frame.f_back, depth + 1
    warnings.warn(message, stacklevel=depth + 1)


def _shape(value) -> tuple[int, ...]:
    return tuple(value.shape) if _is_array(value) else np.shape(value)


class NativeSparseAttention(Kernel[NativeSparseAttentionConfig, jax.Array]):
    """ejkernel's NativeSparseAttention kernel; `block_size` is the key-block size of the
    configurations it chooses (an explicit cfg brings its own)."""

    op_id = "native_sparse_attention"
    version = "1"
    config_type = NativeSparseAttentionConfig

    def __init__(self, block_size: int = 64) -> None:
        self.block_size = NativeSparseAttentionConfig(block_size=block_size).block_size

    def static_settings(self) -> Mapping[str, Any]:
        return {"block_size": self.block_size}

    def run(self, query, key, value, g_cmp=None, g_slc=None, block_indices=None, block_counts=16, softmax_scale=None,
            cu_seqlens=None, platform=None, *, cfg: NativeSparseAttentionConfig) -> jax.Array:
        """nsa_dsl.native_sparse_attention with configuration `cfg`; `platform` (None, "auto",
        "xla", "triton", "pallas") takes precedence over cfg.platform."""
        plan = nsa_plan(cfg.block_size, g_cmp, block_indices, block_counts)
        if g_cmp is not None and block_indices is not None:
            _warn_at_caller("native_sparse_attention: block_indices are ignored when g_cmp is given (top-k selects the blocks)")
        selection = {} if g_cmp is not None else {"block_indices": block_indices, "block_counts": block_counts}
        layer = following_placement(plan, cfg, query, key, value, g_cmp, g_slc, *selection.values(), given={})
        if layer is not None:
            return layer(query, key, value, g_cmp=g_cmp, g_slc=g_slc, cu_seqlens=cu_seqlens,
                         softmax_scale=softmax_scale, platform=platform, **selection)
        platform = choose_platform(plan, platform, cfg)
        impl = self.get_impl(dataclasses.replace(cfg, platform=platform))
        gates = {"g_slc": g_slc} if g_cmp is None else {"g_cmp": g_cmp, "g_slc": g_slc}
        return impl(plan, query, key, value, gates=gates, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale, config=cfg,
                    **selection)

    # -- what an invocation runs ----------------------------------------------------------------

    def plan_for(self, inv: Invocation) -> p.Plan:
        a = inv.arguments
        return nsa_plan(self.block_size, a["g_cmp"], a["block_indices"], a["block_counts"])

    def platform_for(self, inv: Invocation) -> str:
        return _platform(self.plan_for(inv), inv.arguments["platform"], jax.default_backend())

    def heuristic_cfg(self, inv: Invocation) -> NativeSparseAttentionConfig:
        """The kernels' own measured defaults (tile settings None) on the invocation's platform."""
        return NativeSparseAttentionConfig(block_size=self.block_size, platform=self.platform_for(inv),
                                           backend=jax.default_backend())

    def reference_cfg(self, inv: Invocation) -> NativeSparseAttentionConfig:
        return NativeSparseAttentionConfig(block_size=self.block_size, platform="xla", backend=jax.default_backend())

    def admits(self, inv: Invocation, cfg: NativeSparseAttentionConfig) -> bool:
        """The block size is the result's meaning, the backend the device's kernels'."""
        return cfg.block_size == self.block_size and cfg.backend in (None, jax.default_backend())

    def tunes_lazily(self, inv: Invocation) -> bool:
        """Compiled GPU/TPU kernels (Triton, Pallas) are tuned the first time a shape is seen;
        XLA, and the interpreters on a CPU, run their defaults unless asked to tune."""
        return self.platform_for(inv) in ("triton", "pallas") and jax.default_backend() in ("gpu", "tpu")

    def fingerprint(self, inv: Invocation) -> str:
        platform = self.platform_for(inv)
        text = f"{plan_literal(self.plan_for(inv))}\n{platform}\n{_templates_digest(platform)}"
        return hashlib.sha256(text.encode()).hexdigest()

    # -- candidates -----------------------------------------------------------------------------

    def _distinct(self, inv: Invocation, cfgs: Iterable[NativeSparseAttentionConfig],
                  device: str) -> list[NativeSparseAttentionConfig]:
        """`cfgs` with the settings their kernels do not read cleared, repeats dropped."""
        out = []
        for cfg in cfgs:
            read = settings_read(cfg.platform, self.plan_for(inv), device)
            out.append(dataclasses.replace(cfg, **{name: None for name in _SPEED_SETTINGS if name not in read}))
        return list(dict.fromkeys(out))

    def candidate_cfgs_gpu(self, inv: Invocation) -> list[NativeSparseAttentionConfig]:
        """Each tile size the kernels read 32/64/128 x warps 4/8 x stages 1..3 (Triton's keys
        per step, block_k, for selections; Pallas' query tile rows, block_q, for the branches
        that have query tiles). The platform is the invocation's: Triton on NVIDIA GPUs."""
        platform = self.platform_for(inv)
        if platform == "xla":
            return self.candidate_cfgs_xla(inv)
        base = self.heuristic_cfg(inv)
        plan = self.plan_for(inv)
        tiles = {name: GPU_TILES for name in ("block_q", "block_k") if name in settings_read(platform, plan, "gpu")}
        if platform == "triton" and all(isinstance(b, p.SelectBranch) for b in plan.branches):
            # Fewer keys a step than the padded selection block is one block a step all the same.
            tiles["block_k"] = sorted({max(tile, next_power_of_two(self.block_size, 16)) for tile in GPU_TILES})
        grid = [dict(zip(tiles, sizes, strict=True)) for sizes in itertools.product(*tiles.values())]
        cfgs = (dataclasses.replace(base, **sizes, num_warps=w, num_stages=s)
                for s in GPU_STAGES for w in GPU_WARPS for sizes in grid)
        return self._distinct(inv, [base, *cfgs], "gpu")

    def candidate_cfgs_tpu(self, inv: Invocation) -> list[NativeSparseAttentionConfig]:
        """Pallas tiles 64/128 (the heuristic alone while the TPU kernels read none)."""
        platform = self.platform_for(inv)
        if platform == "xla":
            return self.candidate_cfgs_xla(inv)
        base = self.heuristic_cfg(inv)
        grid = (dataclasses.replace(base, block_q=q, block_k=k) for q in TPU_TILES for k in TPU_TILES)
        return self._distinct(inv, [base, *grid], "tpu")

    def candidate_cfgs_xla(self, inv: Invocation) -> list[NativeSparseAttentionConfig]:
        """The XLA engine's chunk size: its default and a smaller and a larger one. Kernels run
        by an interpreter on a CPU are for tests: their default only."""
        base = self.heuristic_cfg(inv)
        if base.platform != "xla":
            return [base]
        chunks = XLA_CHUNK_MIB.get(jax.default_backend(), XLA_CHUNK_MIB["cpu"])
        return self._distinct(inv, [base, *(dataclasses.replace(base, chunk_bytes=mib << 20) for mib in chunks)],
                              jax.default_backend())

    # -- tuning inputs ----------------------------------------------------------------------------

    def tuning_arguments(self, inv: Invocation, rng: np.random.Generator) -> dict[str, Any]:
        """Random q/k/v (normal) and gates (uniform in (0, 1)); a causal selection of distinct
        blocks per token in the caller's layout; the caller's cu_seqlens when concrete, else
        random sequence lengths; counts in [1, S]."""
        a = dict(inv.arguments)
        batch, seq_len, _, head_dim = _shape(a["query"])
        heads_kv = _shape(a["key"])[2]

        def like(x, values):
            return jnp.asarray(values.astype(np.dtype(x.dtype)))

        out = dict(a)
        for name in ("query", "key", "value"):
            out[name] = like(a[name], rng.standard_normal(_shape(a[name])))
        for name in ("g_cmp", "g_slc"):
            if a[name] is not None:
                out[name] = like(a[name], rng.uniform(0.0, 1.0, _shape(a[name])))
        if _is_array(a["softmax_scale"]):
            out["softmax_scale"] = jnp.asarray(1.0 / math.sqrt(head_dim), a["softmax_scale"].dtype)
        cu = None
        if a["cu_seqlens"] is not None:
            cu = (np.asarray(a["cu_seqlens"]) if _is_concrete(a["cu_seqlens"])
                  else _random_offsets(rng, _shape(a["cu_seqlens"])[0] - 1, seq_len))
            out["cu_seqlens"] = jnp.asarray(cu.astype(np.int32))
        if a["g_cmp"] is not None:
            out["block_indices"] = None  # ignored: top-k selects the blocks
            return out
        indices_shape = _shape(a["block_indices"])
        per_token = indices_shape[:3] == (batch, seq_len, heads_kv)
        if per_token:
            rows = np.arange(seq_len)
            starts = 0 if cu is None else cu[np.clip(np.searchsorted(cu, rows, "right") - 1, 0, len(cu) - 1)]
            own_block = ((rows - starts) // self.block_size)[None, :, None]
        else:
            own_block = np.arange(indices_shape[2])[None, None, :]
        out["block_indices"] = jnp.asarray(_distinct_causal_blocks(rng, indices_shape, own_block).astype(np.int32))
        if _is_array(a["block_counts"]):
            out["block_counts"] = jnp.asarray(rng.integers(1, indices_shape[3] + 1, _shape(a["block_counts"])).astype(np.int32))
        return out

    def check_slice(self, inv: Invocation, arguments: Mapping[str, Any]) -> tuple[dict, Callable]:
        """The first batch row's first CHECK_TOKENS tokens (at least 4 blocks) on XLA: the
        attention is causal within each sequence, so they do not depend on later tokens."""
        batch, seq_len, _, _ = _shape(arguments["query"])
        heads_kv = _shape(arguments["key"])[2]
        tokens = min(seq_len, max(CHECK_TOKENS, 4 * self.block_size))
        blocks = -(-tokens // self.block_size)
        sliced = dict(arguments, platform="xla")
        for name in ("query", "key", "value", "g_cmp", "g_slc"):
            if arguments[name] is not None:
                sliced[name] = arguments[name][:1, :tokens]
        for name in ("block_indices", "block_counts"):
            x = arguments[name]
            if _is_array(x) and _shape(x):  # a 0-d count is every token's: nothing to cut
                per_token = _shape(x)[:3] == (batch, seq_len, heads_kv)  # as runtime.validate tells the layouts apart
                sliced[name] = x[:1, :tokens] if per_token else x[:1, :, :blocks]
        if arguments["cu_seqlens"] is not None:
            sliced["cu_seqlens"] = jnp.minimum(arguments["cu_seqlens"], tokens)
        return sliced, lambda out: out[:1, :tokens]


def _random_offsets(rng: np.random.Generator, count: int, total: int) -> np.ndarray:
    """cu_seqlens of `count` random-length sequences filling `total` tokens."""
    cuts = np.sort(rng.integers(0, total + 1, max(count - 1, 0)))
    return np.concatenate([[0], cuts, [total]]).astype(np.int64)


def _distinct_causal_blocks(rng: np.random.Generator, shape: tuple[int, ...], own_block: np.ndarray) -> np.ndarray:
    """Block ids of `shape` [..., S]: per row, S distinct blocks uniformly among 0..own_block
    (own_block broadcasts to shape[:-1]); rows with fewer blocks than S fill the rest with ids
    past own_block, which the kernels ignore. Sorted uniforms u_0 <= ... <= u_{S-1} give
    distinct ids floor(u_i * (n - S + 1)) + i in [0, n)."""
    entries = shape[-1]
    available = np.broadcast_to(own_block + 1, shape[:-1])[..., None]
    room = np.maximum(available - entries + 1, 1)
    return np.floor(np.sort(rng.random(shape), axis=-1) * room).astype(np.int64) + np.arange(entries)
