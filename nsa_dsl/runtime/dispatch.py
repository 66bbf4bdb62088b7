"""Running a plan: validate the inputs, build the host tables, call the generated kernel."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping

import jax
import numpy as np

from .. import codegen
from ..config import NativeSparseAttentionConfig
from ..plan import build_block_table
from ..plan import plan as p
from . import validate
from .platform import for_device, resolve_platform

# Branch kinds each platform's templates implement.
_KERNELS = {"xla": (p.StaticBranch, p.SelectBranch, p.CompressBranch, p.TopKBranch), "triton": (p.StaticBranch, p.SelectBranch), "pallas": (p.SelectBranch,)}


def supports(plan: p.Plan, platform: str) -> bool:
    return all(isinstance(branch, _KERNELS.get(platform, ())) for branch in plan.branches)


def choose_platform(plan: p.Plan, requested: str | None, config: NativeSparseAttentionConfig | None) -> str:
    """`requested` (or the config's) as resolve_platform checks it; automatically, the most
    specialised available platform with kernels for every branch of the plan (XLA has all)."""
    return resolve_platform(requested, config, runs=lambda platform: supports(plan, platform))


def check_supported(plan: p.Plan, platform: str) -> None:
    """Raise NotImplementedError if `platform` has no kernel for one of the plan's branches."""
    kinds = _KERNELS.get(platform, ())
    for branch in plan.branches:
        if not isinstance(branch, kinds):
            raise NotImplementedError(
                f"the {platform} backend has no kernel for {type(branch).__name__} branches "
                f"(branch {branch.name!r} of pattern {plan.name!r})"
            )


@functools.lru_cache(maxsize=64)
def block_table(static: p.StaticKeys, block_size: int, causal: bool, seq_len: int) -> tuple[np.ndarray, ...]:
    """(indices, counts, full, atom_bits) of a static key set's table, built once per length."""
    table = build_block_table(static, block_size, causal, seq_len)
    return table.indices, table.counts, table.full, table.atom_bits


def branch_tables(plan: p.Plan, seq_len: int) -> dict[str, tuple[np.ndarray, ...]]:
    """The host tables of a plan's branches: a static branch's block table (indices, counts,
    full, atom_bits); a top-k branch's forced blocks as (indices, counts) over selection blocks
    (no entries when nothing is forced)."""
    tables = {}
    for branch in plan.branches:
        if isinstance(branch, p.StaticBranch):
            tables[branch.name] = block_table(branch.static, plan.block_size, plan.causal, seq_len)
        elif isinstance(branch, p.TopKBranch):
            forced = block_table(branch.force, branch.block, True, seq_len) if branch.force is not None else None
            tables[branch.name] = forced[:2] if forced is not None else _nothing_forced(branch.block, seq_len)
    return tables


@functools.lru_cache(maxsize=64)
def _nothing_forced(block: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    rows = -(-seq_len // block)
    return np.full((rows, 1), -1, dtype=np.int32), np.zeros(rows, dtype=np.int32)


@functools.lru_cache(maxsize=None)
def kernel(platform: str, plan: p.Plan, config: NativeSparseAttentionConfig | None, entry: str = "attention") -> Callable:
    """The generated module's jitted `entry` function for (platform, plan, config)."""
    check_supported(plan, platform)
    use_compilation_cache()
    return jax.jit(getattr(codegen.load_module(platform, plan, for_device(config)), entry))


@functools.lru_cache(maxsize=1)
def use_compilation_cache() -> None:
    """Keep compiled executables on disk beside the generated modules, so that a new process
    does not compile a pattern again: JAX's persistent compilation cache, under
    $NSA_DSL_CACHE_DIR/jax, unless the application configured one (or NSA_DSL_JAX_CACHE=0).
    Triton keeps its compiled kernels in its own disk cache."""
    if os.environ.get("NSA_DSL_JAX_CACHE") == "0" or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(codegen.cache_root() / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def selections(plan: p.Plan, query, key, value, *, cu_seqlens=None, softmax_scale=None, platform=None, config=None,
               pool_fns: Mapping[str, Callable] | None = None):
    """{top-k branch name: [B, T, HKV, count] selected block ids (-1 unused)} of `plan`."""
    if not any(isinstance(b, p.TopKBranch) for b in plan.branches):
        raise ValueError(f"pattern {plan.name!r} has no topk branch")
    query, key, value, shapes = validate.attention_inputs(query, key, value)
    return entry(choose_platform(plan, platform, config), plan, config, "selections", pool_fns)(
        query,
        key,
        value,
        tables=branch_tables(plan, shapes.seq_len),
        cu_seqlens=validate.cu_seqlens(cu_seqlens, shapes),
        softmax_scale=validate.softmax_scale(softmax_scale, shapes),
    )


def entry(platform: str, plan: p.Plan, config, name: str, pool_fns: Mapping[str, Callable] | None) -> Callable:
    """The generated `name` function to call: jitted and cached when the plan pools with its
    own means; with learned pooling functions, the module's function itself (the functions
    close over parameters, so the caller's jit traces them along)."""
    learned = sorted(b.name for b in plan.branches if isinstance(b, p.CompressBranch) and b.pool == "learned")
    given = dict(pool_fns or {})
    if sorted(given) != learned:
        raise ValueError(
            f"pool_fns: pattern {plan.name!r} pools with learned functions in branches {learned or 'none'}; "
            f"got functions for {sorted(given) or 'none'}"
        )
    for branch, fn in given.items():
        if not callable(fn):
            raise ValueError(f"pool_fns[{branch!r}] must be a callable (k_blocks, v_blocks) -> (k_cmp, v_cmp)")
    if not given:
        return kernel(platform, plan, config, name)
    check_supported(plan, platform)
    return functools.partial(getattr(codegen.load_module(platform, plan, for_device(config)), name), pool_fns=given)


def attend(
    plan: p.Plan,
    query,
    key,
    value,
    *,
    gates: Mapping[str, object] | None = None,
    cu_seqlens=None,
    softmax_scale=None,
    block_indices=None,
    block_counts=None,
    platform: str | None = None,
    config: NativeSparseAttentionConfig | None = None,
    pool_fns: Mapping[str, Callable] | None = None,
):
    """Sparse attention of `plan` on [B, T, H, D] inputs; see the generated module's contract."""
    query, key, value, shapes = validate.attention_inputs(query, key, value)
    declared = tuple(dict.fromkeys(gate.name for gate in plan.gates))
    given = validate.gates(gates or {}, declared, plan.name, shapes)
    cu = validate.cu_seqlens(cu_seqlens, shapes)
    scale = validate.softmax_scale(softmax_scale, shapes)
    explicit = [b for b in plan.branches if isinstance(b, p.SelectBranch)]
    if explicit:
        block_indices, block_counts = validate.selection(block_indices, block_counts, shapes, explicit[0].block, cu)
    else:
        for name, given_value in (("block_indices", block_indices), ("block_counts", block_counts)):
            if given_value is not None:
                raise ValueError(f"{name}: pattern {plan.name!r} has no branch that selects key blocks explicitly")
    platform = choose_platform(plan, platform, config)
    tables = branch_tables(plan, shapes.seq_len)
    return entry(platform, plan, config, "attention", pool_fns)(
        query,
        key,
        value,
        gates=given,
        tables=tables,
        cu_seqlens=cu,
        softmax_scale=scale,
        block_indices=block_indices,
        block_counts=block_counts,
    )
