"""The public API: ejkernel's `native_sparse_attention`, and `compile` for `.nsa` patterns."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import jax

from . import codegen, dsl
from .config import PLATFORMS, NativeSparseAttentionConfig
from .dsl import model
from .kernel import NativeSparseAttention, compressed_selection_plan, selection_plan
from .plan import lower
from .plan import plan as p
from .runtime import (
    attend,
    check_supported,
    choose_platform,
    compressed_cache,
    selections,
)
from .runtime.check import CheckReport, check_pattern
from .runtime.platform import for_device, has_generator
from .sharding import ShardedAttention, following_placement, on_explicit_axes

__all__ = [
    "CheckReport",
    "SparseAttention",
    "check_pattern",
    "compile",
    "compressed_selection_plan",
    "native_sparse_attention",
    "selection_plan",
]


def native_sparse_attention(
    query,
    key,
    value,
    g_cmp=None,
    g_slc=None,
    block_indices=None,
    block_counts=16,
    cu_seqlens=None,
    /,
    *,
    softmax_scale=None,
    platform: str | None = None,
    cfg: NativeSparseAttentionConfig | str | None = None,
):
    """ejkernel's `native_sparse_attention`.

    query [B, T, HQ, D], key/value [B, T, HKV, D] (HQ a multiple of HKV); gates [B, T, HQ].
    With `block_indices` [B, T, HKV, S] (or ejkernel's per-query-block [B, HKV, ceil(T / block), S]),
    token t attends key s of its own sequence iff s <= t and s's block (of cfg.block_size
    tokens) is among the first `block_counts` (int, [B, T, HKV] or [B, HKV, num_blocks])
    entries of t's row; out-of-range entries are ignored. With `cu_seqlens` [N + 1] (B == 1)
    positions and block ids count from the start of t's own sequence. Returns
    o_slc * g_slc (o_slc if g_slc is None) in query's dtype; softmax_scale defaults to
    1/sqrt(D) and may be traced.

    With `g_cmp` given, the blocks are chosen on device instead (block_indices are ignored):
    keys and values are mean-pooled per block of cfg.block_size, the compressed attention's
    probabilities (summed over each KV group's query heads) score the blocks, and the
    top `block_counts` (an int) causally valid blocks, always including the query's own, are
    attended; o = g_slc * o_slc + g_cmp * o_cmp.

    `cfg`: a NativeSparseAttentionConfig is used as given. None (block_size 64): the tuned
    configuration of these shapes on this device if one is stored, else the kernels' defaults,
    tuning first where compiled GPU/TPU kernels run (NSA_DSL_AUTOTUNE=0: never, =1: always);
    "autotune": tune now unless stored; "heuristic": the defaults. `platform` ("xla", "triton",
    "pallas"), when given, takes precedence over cfg.platform. See nsa_dsl.NativeSparseAttention.
    """
    return _KERNEL(query, key, value, g_cmp, g_slc, block_indices, block_counts, softmax_scale, cu_seqlens, platform,
                   cfg=cfg)


_KERNEL = NativeSparseAttention()

# Compiler options for a jitted decoding step: `jax.jit(step, compiler_options=DECODE_COMPILER_OPTIONS)`.
# A step runs some twenty small kernels (the Triton kernels and the index arithmetic between them); XLA
# records a run of kernels into a CUDA graph only from 5 in a row by default, so the few between two
# Triton launches were launched one by one. Graphs of any length took an H200's step (8 sequences
# at 8k tokens) from 0.39 to 0.23 ms. Other backends ignore the option.
DECODE_COMPILER_OPTIONS = {"xla_gpu_graph_min_graph_size": 1}


@dataclass(frozen=True)
class SparseAttention:
    """A compiled pattern: call it like an attention function.

    `plan` is what kernels are generated from; `source(platform)` is the generated module.
    """

    pattern: model.Pattern
    plan: p.Plan
    config: NativeSparseAttentionConfig | None = None

    def source(self, platform: str | None = None) -> str:
        """The generated module's source for `platform` (None: the one calls would run on). A
        platform named here needs none of its packages installed: rendering imports none of them,
        as nsa-compile writes the module."""
        return codegen.source(*self._generated(platform))

    def module_path(self, platform: str | None = None) -> Path:
        """The file in the on-disk cache that calls on `platform` (as for source()) import the
        generated module from, written now if it is not there yet (where the cache cannot be
        written it does not exist, or holds a damaged entry the cache could not replace: calls run
        the module from memory, with a CacheWarning)."""
        generated = self._generated(platform)
        codegen.source(*generated)
        return codegen.cache_path(*generated)

    def _generated(self, platform: str | None) -> tuple[str, p.Plan, NativeSparseAttentionConfig]:
        """(platform, plan, device configuration) naming the generated module of `platform`."""
        if not (platform in PLATFORMS and has_generator(platform)):
            platform = choose_platform(self.plan, platform, self.config)
        check_supported(self.plan, platform)
        return platform, self.plan, for_device(self.config)

    def selections(self, query, key, value, *, cu_seqlens=None, softmax_scale=None, platform: str | None = None,
                   pool_fns=None, query_offset=None, scoring_query=None, compressed=None):
        """The key blocks each topk branch selects for these inputs:
        {branch name: [B, Tq, HKV, min(count, ceil(T / block))] block ids of the branch's block size,
        -1 unused};
        query_offset, scoring_query and compressed as for calls."""
        decoding = {"query_offset": query_offset, "scoring_query": scoring_query, "compressed": compressed}
        layer = following_placement(self.plan, self.config, query, key, value, given=decoding)
        if layer is not None:
            return layer.selections(query, key, value, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale,
                                    platform=platform, pool_fns=pool_fns)
        return selections(self.plan, query, key, value, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale,
                          platform=platform, config=self.config, pool_fns=pool_fns, **decoding)

    def compress(self, key, value, *, cu_seqlens=None, pool_fns=None, cache=None, new_rows=None):
        """The compressed keys and values of this pattern's compress branches for key/value
        [B, T, HKV, D], kept beside a key/value cache for decoding: pass them to calls as
        `compressed=` and the compress branches read them instead of pooling all T keys again
        (a CompressedCache: {branch name: (k_cmp, v_cmp)}, [B, T // stride + 1 (or + N with cu_seqlens), HKV, D] in
        the keys' dtype, recording how each branch pooled, so that calls of another pattern refuse it;
        a call computes what it would without them, up to the rounding of the float32 pooling).

        After writing key rows [first, first + count) of the cache, `compress(key, value,
        cache=cache, new_rows=(first, count))` recomputes only the compressed keys that pool them
        (first may be traced, and may be one per batch row [B]; count is static): O(count) work,
        jit- and scan-friendly. Keys sharded along Explicit mesh axes are refused: pool them inside
        your own jax.shard_map (batch and head sharding need no communication)."""
        if on_explicit_axes(key, value, *jax.tree.leaves(cache)):
            raise ValueError(
                "key: compress takes keys and values that are not sharded along Explicit mesh axes; with the batch or "
                "the heads sharded, call it inside your own jax.shard_map (each device pools its own rows and heads)"
            )
        return compressed_cache.pool(self.plan, key, value, cu_seqlens=cu_seqlens, pool_fns=pool_fns, cache=cache,
                                     new_rows=new_rows)

    def sharded(self, mesh=None, *, batch_axis=None, head_axis=None, sequence_axis=None):
        """This attention over a device mesh (nsa_dsl.sharding.ShardedAttention): called on global
        arrays it runs inside jax.shard_map with the batch, the heads (each KV head with its
        query heads) and the sequence (context parallel: keys and values all-gathered, queries
        at their absolute rows) sharded along the named mesh axes; `.per_shard` is the same
        inside your own shard_map. mesh=None: the one set with jax.set_mesh."""
        return ShardedAttention(self.plan, self.config, mesh, batch_axis, head_axis, sequence_axis)

    def __call__(
        self,
        query,
        key,
        value,
        *,
        g_cmp=None,
        g_slc=None,
        g_swa=None,
        cu_seqlens=None,
        softmax_scale=None,
        platform: str | None = None,
        block_indices=None,
        block_counts=None,
        pool_fns=None,
        query_offset=None,
        scoring_query=None,
        compressed=None,
        **extra_gates,
    ):
        """Sparse attention of this pattern. Gates ([B, T, HQ]) are passed by the names the
        pattern declares (g_cmp, g_slc, g_swa or its own); a branch whose gate is not passed
        weighs its declared default, or is skipped if it has none. `pool_fns` maps each compress
        branch declared with pool=learned to its pooling function
        (k_blocks [C, l, HKV, D], v_blocks) -> (k_cmp [C, HKV, D], v_cmp).

        Fewer queries than keys: query [B, Tq, HQ, D] (and the gates and block_indices/counts of
        those rows) are rows [query_offset, query_offset + Tq) of key's sequence axis, e.g. the
        new tokens of a decoding step against a key/value cache of T >= query_offset + Tq rows
        (with `causal`, the cache's rows past a query do not change its output; they must be
        finite, as a zero-initialised cache's are: kernels load whole tiles). query_offset: an int or
        an int32 scalar, or one per batch row (an integer [B] array: sequences decoded at positions
        of their own, as continuous batching does), may be traced. For a top-k per block(Q) they must be whole blocks of
        the pattern, and on packed sequences `scoring_query` [B, T, HQ, D] every query.
        `compressed`: the keys' compressed cache (see `compress`), for decoding steps.

        Arrays sharded along Explicit mesh axes (under jax.set_mesh) run where they lie: the call
        is `sharded(...)` along the query's batch, sequence and head axes."""
        gates = {"g_cmp": g_cmp, "g_slc": g_slc, "g_swa": g_swa, **extra_gates}
        decoding = {"query_offset": query_offset, "scoring_query": scoring_query, "compressed": compressed}
        layer = following_placement(self.plan, self.config, query, key, value, *gates.values(), block_indices,
                                    block_counts, given=decoding)
        if layer is not None:
            return layer(query, key, value, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale, platform=platform,
                         block_indices=block_indices, block_counts=block_counts, pool_fns=pool_fns, **gates)
        return attend(
            self.plan,
            query,
            key,
            value,
            gates=gates,
            cu_seqlens=cu_seqlens,
            softmax_scale=softmax_scale,
            block_indices=block_indices,
            block_counts=block_counts,
            platform=platform,
            config=self.config,
            pool_fns=pool_fns,
            **decoding,
        )


def compile(
    path_or_source: str | os.PathLike,
    *,
    pattern: str | None = None,
    config: NativeSparseAttentionConfig | None = None,
    **params,
) -> SparseAttention:
    """Compile a `.nsa` pattern (a file path or the text itself) into a SparseAttention.

    `pattern` picks one pattern of a file that declares several; `params` override the
    pattern's params (nsa_dsl.compile("longformer.nsa", window=1024)). Raises NsaSyntaxError or
    NsaSemanticError, located in the source, for bad text.
    """
    config = None if config is None else NativeSparseAttentionConfig.of(config, "config", "or None")
    if pattern is not None and not isinstance(pattern, str):
        raise ValueError(f"pattern must be a str or None, got {type(pattern).__name__}")
    checked = dsl.load_pattern(path_or_source, name=pattern, overrides=params)
    return SparseAttention(checked, lower(checked), config)

