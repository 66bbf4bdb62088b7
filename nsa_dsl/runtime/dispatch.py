"""Running a plan: validate the inputs, build the host tables, call the generated kernel."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import numpy as np

from .. import codegen
from ..config import NativeSparseAttentionConfig
from ..plan import build_block_table
from ..plan import plan as p
from . import batching, compressed_cache, jax_cache, validate
from .promotion import allowing_rank_promotion
from .platform import PlatformLimitError, available_platforms, for_device, resolve_platform

# Branch kinds each platform's templates implement (Pallas: its GPU and its TPU variant alike).
_EVERY_KIND = (p.StaticBranch, p.SelectBranch, p.CompressBranch, p.TopKBranch)
_KERNELS = {"xla": _EVERY_KIND, "triton": _EVERY_KIND, "pallas": _EVERY_KIND}


# Platforms whose kernels take a shard of the queries against all keys (query_offset: context
# parallelism): Pallas' GPU variant does, its TPU variant does not.
_QUERY_SHARD_PLATFORMS = ("xla", "triton", "pallas")


def takes_query_shard(platform: str, config: NativeSparseAttentionConfig | None = None) -> bool:
    """Whether `platform`'s kernels (for the device `config` generates for) take a shard of the queries."""
    return platform in _QUERY_SHARD_PLATFORMS and not (platform == "pallas" and for_device(config).backend == "tpu")


def supports(plan: p.Plan, platform: str, *, query_shard: bool = False, config=None) -> bool:
    kernels = all(isinstance(branch, _KERNELS.get(platform, ())) for branch in plan.branches)
    return kernels and (not query_shard or takes_query_shard(platform, config))


def choose_platform(
    plan: p.Plan, requested: str | None, config: NativeSparseAttentionConfig | None, *, query_shard: bool = False
) -> str:
    """`requested` (or the config's) as resolve_platform checks it; automatically, the most
    specialised available platform with kernels for every branch of the plan (XLA has all) and,
    for a `query_shard` (queries fewer than keys), for a shard of the queries."""
    platform = resolve_platform(
        requested, config, runs=lambda name: supports(plan, name, query_shard=query_shard, config=config)
    )
    if query_shard and not takes_query_shard(platform, config):
        able = [name for name in available_platforms(config) if takes_query_shard(name, config)]
        raise NotImplementedError(
            f"context parallelism (a shard of the queries against all keys, query_offset) is not implemented "
            f"by the {platform} backend on {for_device(config).backend.upper()}; here {', '.join(map(repr, able))} "
            f"supports it"
        )
    return platform


def run_on_platform(
    plan: p.Plan, requested: str | None, config: NativeSparseAttentionConfig | None, query_shard: bool,
    call: Callable[[str], object],
):
    """call(platform) on choose_platform's platform. One chosen automatically (neither `requested`
    nor the config's platform names one) whose kernels cannot take these shapes (PlatformLimitError,
    raised while tracing) gives way to XLA, with a warning; a platform asked for by name raises."""
    platform = choose_platform(plan, requested, config, query_shard=query_shard)
    try:
        return call(platform)
    except PlatformLimitError as err:
        named = requested if requested not in (None, "auto") else getattr(config, "platform", None)
        if platform == "xla" or named not in (None, "auto"):
            raise
        warnings.warn(f"{err}. Running pattern {plan.name!r} on XLA instead.", stacklevel=4)
        return call("xla")


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


def branch_tables(plan: p.Plan, seq_len: int, names: Sequence[str] | None = None) -> dict[str, tuple[np.ndarray, ...]]:
    """The host tables of a plan's branches (those in `names`, default all): a static branch's
    block table (indices, counts, full, atom_bits); a top-k branch's forced blocks as (indices,
    counts) over selection blocks (no entries when nothing is forced)."""
    tables = {}
    for branch in plan.branches:
        if names is not None and branch.name not in names:
            continue
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
def generated_module(platform: str, plan: p.Plan, config: NativeSparseAttentionConfig | None):
    """The generated module of (platform, plan, config), looked up once: finding it computes its
    cache key, which reads every template (~10 ms a call that looked it up each time)."""
    return codegen.load_module(platform, plan, for_device(config))


@functools.lru_cache(maxsize=None)
def kernel(
    platform: str, plan: p.Plan, config: NativeSparseAttentionConfig | None, entry: str = "attention"
) -> Callable:
    """The generated module's jitted `entry` function for (platform, plan, config)."""
    check_supported(plan, platform)
    return jax.jit(getattr(generated_module(platform, plan, config), entry))


def use_compilation_cache() -> None:
    """Keep compiled executables on disk beside the generated modules, so that a new process
    does not compile a pattern again: JAX's persistent compilation cache, under
    $NSA_DSL_CACHE_DIR/jax, unless the application configured one (or NSA_DSL_JAX_CACHE=0), with
    the entries a killed process left damaged removed first (jax_cache.discard_damaged). JAX's
    cache is the process's: from then on it holds every executable the process compiles.
    Called at every call, so that a directory deleted while the process runs is made again (JAX
    would fail to write every later entry). A directory this process cannot write is used for
    reading, with one CacheWarning instead of JAX's warning at every entry it fails to write.
    Triton kernels compiled through jax-triton have their own cache (runtime/triton_cache.py)."""
    if os.environ.get("NSA_DSL_JAX_CACHE") == "0":
        return
    directory = codegen.cache_root() / "jax"
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        if configured == str(directory):  # ours, made again if it was deleted under this process
            with contextlib.suppress(OSError):
                directory.mkdir(parents=True, exist_ok=True)
        return  # else the application's, or ours before $NSA_DSL_CACHE_DIR moved (JAX keeps the first it used)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        warnings.warn(f"JAX's compilation cache stays off: cannot make {directory}: {err.strerror or err}",
                      codegen.CacheWarning, stacklevel=3)
        return
    if not os.access(directory, os.W_OK):
        warnings.warn(f"{directory} cannot be written: JAX's compilation cache there is read, and takes no new "
                      "executable", codegen.CacheWarning, stacklevel=3)
        warnings.filterwarnings("ignore", message="Error writing persistent compilation cache entry")
    jax_cache.discard_damaged(directory)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@allowing_rank_promotion
def selections(
    plan: p.Plan,
    query,
    key,
    value,
    *,
    cu_seqlens=None,
    softmax_scale=None,
    platform=None,
    config=None,
    pool_fns: Mapping[str, Callable] | None = None,
    query_offset=None,
    scoring_query=None,
    compressed=None,
):
    """{top-k branch name: [B, Tq, HKV, min(count, ceil(T / block))] selected block ids (-1 unused)} of `plan`;
    query_offset, scoring_query and compressed as for `attend`."""
    if not any(isinstance(b, p.TopKBranch) for b in plan.branches):
        raise ValueError(f"pattern {plan.name!r} has no topk branch")
    use_compilation_cache()  # before the inputs' checks, whose operations compile too
    query, key, value, shapes = validate.attention_inputs(query, key, value, query_shard=query_offset is not None)
    cu = validate.cu_seqlens(cu_seqlens, shapes)
    shard = _query_shard(plan, query, query_offset, scoring_query, shapes, cu)
    scale = validate.softmax_scale(softmax_scale, shapes)
    cached = _compressed(plan, compressed, shapes, cu, key.dtype)

    def select(chosen: str):
        fitted = kernel_plan(chosen, plan, shapes.seq_len)
        return entry(chosen, fitted, config, "selections", pool_fns, pools=not cached)(
            query, key, value, tables=kernel_tables(chosen, fitted, config, shapes.seq_len), cu_seqlens=cu,
            softmax_scale=scale, **shard, **cached,
        )

    return run_on_platform(plan, platform, config, bool(shard), select)


def _compressed(plan: p.Plan, compressed, shapes: validate.Shapes, cu, dtype) -> dict:
    """The kernel's compressed argument: none, or the caller's compressed cache of keys of
    `dtype`, validated."""
    if compressed is None:
        return {}
    num_seqs = 1 if cu is None else cu.shape[0] - 1
    return {"compressed": compressed_cache.validated_arrays(plan, compressed, shapes, num_seqs, dtype)}


def grouped_topk(plan: p.Plan) -> str | None:
    """The name of a topk branch that selects per block(Q) of queries (Q > 1), scoring each group as
    one: a shard of its queries must hold whole blocks. None if the plan has none."""
    return next((b.name for b in plan.branches if isinstance(b, p.TopKBranch) and b.query_block > 1), None)


def needs_scoring_query(plan: p.Plan, cu_seqlens) -> bool:
    """Whether a shard of the queries needs every query for its top-k: a per block(Q) group is
    counted from its sequence's start, so with packed sequences it may straddle two shards."""
    return cu_seqlens is not None and grouped_topk(plan) is not None


def _query_shard(plan: p.Plan, query, query_offset, scoring_query, shapes: validate.Shapes, cu) -> dict:
    """The kernel's query_offset and scoring_query arguments: none unless the queries are fewer
    than the keys; scoring_query (checked wherever given) only where the top-k needs it."""
    if query_offset is None:
        if scoring_query is not None:
            raise ValueError("scoring_query is for a shard of the queries: pass query_offset too")
        return {}
    offset = validate.query_offset(query_offset, shapes, plan.block_size if grouped_topk(plan) else None)
    if scoring_query is not None:
        scoring_query = validate.scoring_query(scoring_query, query, shapes)
    if shapes.query_len == shapes.seq_len:
        return {}  # the offset is 0
    if not needs_scoring_query(plan, cu):
        return {"query_offset": offset}
    if scoring_query is None:
        raise ValueError(
            f"scoring_query: topk branch {grouped_topk(plan)!r} of pattern {plan.name!r} selects per block of queries counted "
            f"from each sequence's start, and with cu_seqlens such a block may straddle two shards: pass every "
            f"query of the sequence axis as scoring_query (ShardedAttention does)"
        )
    return {"query_offset": offset, "scoring_query": scoring_query}


def kernel_plan(platform: str, plan: p.Plan, seq_len: int) -> p.Plan:
    """The plan whose module runs on `platform` for keys of seq_len rows. Pallas' static and
    compression kernels tile queries by the pattern's block, a constant of the module: a block past
    the keys runs as the plan fitted to them (Plan.fitted). XLA's and Triton's kernels fit each
    block themselves (layout.fitted_block), and keep the module they have."""
    return plan.fitted(seq_len) if platform == "pallas" else plan


def kernel_tables(platform: str, plan: p.Plan, config, seq_len: int) -> dict[str, tuple[np.ndarray, ...]]:
    """The host tables the platform's generated kernels read (the module's TABLES): a Triton
    kernel computing a branch's key ranges needs no table, which for `causal` at a million
    tokens would hold 16384^2 entries."""
    return branch_tables(plan, seq_len, generated_module(platform, plan, config).TABLES)


def entry(
    platform: str, plan: p.Plan, config, name: str, pool_fns: Mapping[str, Callable] | None, pools: bool = True
) -> Callable:
    """The generated `name` function to call: jitted and cached when the plan pools with its
    own means (or the call does not pool: `pools` False, a compressed cache was given); with
    learned pooling functions, the module's function itself (the functions close over
    parameters, so the caller's jit traces them along)."""
    learned = compressed_cache.learned_branches(plan)
    given = validate.pool_fns(pool_fns, learned if pools or pool_fns else [], plan.name)
    if not given:
        return kernel(platform, plan, config, name)
    check_supported(plan, platform)
    return functools.partial(getattr(generated_module(platform, plan, config), name), pool_fns=given)


class Inputs(NamedTuple):
    """The arguments of a call, validated: arrays, gates by name, sequence offsets, the scale and
    explicit selections in the per-token layout."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    shapes: validate.Shapes
    gates: dict[str, jax.Array]
    cu_seqlens: jax.Array | None
    softmax_scale: float | jax.Array
    block_indices: jax.Array | None
    block_counts: jax.Array | None


def inputs(
    plan: p.Plan,
    query,
    key,
    value,
    *,
    gates=None,
    cu_seqlens=None,
    softmax_scale=None,
    block_indices=None,
    block_counts=None,
    query_shard: bool = False,
) -> Inputs:
    """Validate a call's arguments (ValueError naming the argument); `query_shard`: the queries
    may be fewer than the keys (a query_offset was given)."""
    query, key, value, shapes = validate.attention_inputs(query, key, value, query_shard=query_shard)
    declared = tuple(dict.fromkeys(gate.name for gate in plan.gates))
    given = validate.gates(gates or {}, declared + plan.idle_gates, plan.name, shapes)
    given = {name: gate for name, gate in given.items() if name not in plan.idle_gates}
    cu = validate.cu_seqlens(cu_seqlens, shapes)
    scale = validate.softmax_scale(softmax_scale, shapes)
    explicit = [b for b in plan.branches if isinstance(b, p.SelectBranch)]
    if explicit:
        block_indices, block_counts = validate.selection(block_indices, block_counts, shapes, explicit[0].block, cu)
    else:
        for name, given_value in (("block_indices", block_indices), ("block_counts", block_counts)):
            if given_value is not None:
                raise ValueError(f"{name}: pattern {plan.name!r} has no branch that selects key blocks explicitly")
    return Inputs(query, key, value, shapes, given, cu, scale, block_indices, block_counts)


@allowing_rank_promotion
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
    query_offset=None,
    scoring_query=None,
    compressed=None,
):
    """Sparse attention of `plan` on [B, T, H, D] inputs; see the generated module's contract.

    With `query_offset` (an int or an integer scalar, may be traced) the queries [B, Tq, HQ, D]
    may be a shard of the sequence axis: rows [query_offset, query_offset + Tq) of the keys'
    (context parallelism, or the new tokens of a decoding step); for a top-k per block(Q), Tq and
    query_offset must be multiples of the pattern's block. `compressed`: the keys' compressed
    cache (compressed_cache.pool), which the compress branches then read instead of pooling.
    Gates, block_indices and block_counts are the queries'; cu_seqlens are in key rows. A shard
    of a plan that selects per block(Q) on packed sequences (needs_scoring_query) also needs
    `scoring_query`, the queries of every row [B, T, HQ, D], which its top-k scores from.
    Gradients of a shard's call are its share: dk, dv and the softmax scale's are sums over the
    shards' calls (ShardedAttention adds them over the mesh)."""
    use_compilation_cache()  # before the inputs' checks, whose operations compile too
    given = inputs(
        plan,
        query,
        key,
        value,
        gates=gates,
        cu_seqlens=cu_seqlens,
        softmax_scale=softmax_scale,
        block_indices=block_indices,
        block_counts=block_counts,
        query_shard=query_offset is not None,
    )
    shard = _query_shard(plan, given.query, query_offset, scoring_query, given.shapes, given.cu_seqlens)
    cached = _compressed(plan, compressed, given.shapes, given.cu_seqlens, given.key.dtype)

    def attention(chosen: str):
        fitted = kernel_plan(chosen, plan, given.shapes.seq_len)
        module_attention = entry(chosen, fitted, config, "attention", pool_fns, pools=not cached)
        tables = kernel_tables(chosen, fitted, config, given.shapes.seq_len)

        def call(floats, indices):
            return module_attention(
                *floats["qkv"],
                gates=floats["gates"],
                tables=tables,
                cu_seqlens=given.cu_seqlens,
                softmax_scale=given.softmax_scale,
                **indices,
                **shard,
                **cached,
            )

        floats = {"qkv": (given.query, given.key, given.value), "gates": given.gates}
        indices = {"block_indices": given.block_indices, "block_counts": given.block_counts}
        if chosen == "triton" and _batch_major(given, shard, cached, pool_fns):
            return batching.folding_vmap(call, chosen)(floats, indices)
        return call(floats, indices)

    return run_on_platform(plan, platform, config, bool(shard), attention)


def _batch_major(given: Inputs, shard: dict, cached: dict, pool_fns) -> bool:
    """Whether a call's every array leads with the batch axis and nothing else is traced, so that
    jax.vmap may fold its mapped axis into the batch (batching.folding_vmap): not packed sequences
    (one batch row), a scale given as an array (its gradient would be one sum over the folded rows),
    a shard of the queries or a compressed cache, nor learned pooling (its functions close over
    parameters)."""
    array_scale = not isinstance(given.softmax_scale, float)
    return given.cu_seqlens is None and not array_scale and not shard and not cached and not pool_fns
