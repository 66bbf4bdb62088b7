"""Sparse attention over a device mesh: generated kernels inside `jax.shard_map`.

    attention = nsa_dsl.compile("examples/nsa.nsa")
    mesh = jax.make_mesh((2, 4), ("data", "context"))
    layer = attention.sharded(mesh, batch_axis="data", sequence_axis="context")
    out = layer(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa)   # global arrays in and out

Three ways to split the work, combinable, each an axis of the mesh (or a tuple of axes):

- data parallel (`batch_axis`): batch rows are independent; each device runs its own rows.
- head parallel (`head_axis`): each device runs a contiguous range of KV heads together with the
  query heads of their groups, so no group is split (num_kv_heads must be divisible by the
  axis size).
- context parallel (`sequence_axis`): each device holds T / P consecutive rows of q, k, v, the
  gates and explicit selections. Keys and values are all-gathered along the sequence axis and
  the device's queries attend at their absolute rows (query_offset = shard index * T / P), so
  causality, windows, block tables, compression (compressed keys pool the whole sequence) and
  top-k selection see the keys they see on one device: results and gradients equal the
  single-device ones. The gradient of the gather is a reduce-scatter, leaving each device the
  key/value gradients of its own rows. T / P may be any number of rows (for a top-k per block(Q),
  a multiple of the pattern's block); packed
  sequences (cu_seqlens, global offsets, replicated) may straddle shard boundaries.
  Memory: every device holds the whole sequence's keys and values of its heads; with packed
  sequences and a top-k `per block(Q)`, whose groups may straddle shards, also every query (for
  the top-k scoring, which then runs for the whole sequence on every device).

Data and head parallelism run on every platform; context parallelism needs kernels that take a
shard of the queries: XLA, Triton and Pallas' GPU variant (not its TPU variant, where the
automatic platform is XLA for a sharded sequence).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import jax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import NativeSparseAttentionConfig
from .plan import plan as p
from .runtime import dispatch, validate

AxisName = str | tuple[str, ...] | None

__all__ = [
    "AxisName", "ShardedAttention", "attend_shard", "following_placement", "on_explicit_axes", "selections_shard",
    "sharded_native_sparse_attention",
]


def attend_shard(plan: p.Plan, query, key, value, *, sequence_axis: AxisName = None, **options):
    """`runtime.attend` on one shard, inside `jax.shard_map`: query [B, Tq, HQ, D] and key/value
    [B, Tq, HKV, D] are this device's blocks (and the gates, block_indices and block_counts
    options too); cu_seqlens (global row offsets) and softmax_scale are replicated. With
    `sequence_axis`, the sequence is sharded along it (context parallelism): keys and values are
    gathered from every shard of the axis and the queries attend at their absolute rows. Batch
    and head sharding need no communication (or axis name) here."""
    return _on_shard(dispatch.attend, plan, query, key, value, sequence_axis, options)


def selections_shard(plan: p.Plan, query, key, value, *, sequence_axis: AxisName = None, **options):
    """`runtime.selections` on one shard, inside `jax.shard_map` (as attend_shard)."""
    return _on_shard(dispatch.selections, plan, query, key, value, sequence_axis, options)


def _on_shard(entry, plan: p.Plan, query, key, value, sequence_axis: AxisName, options: dict):
    """`entry` (dispatch.attend or dispatch.selections) of one shard's queries: with
    sequence_axis, against the keys and values of the whole sequence (_whole_sequence)."""
    if sequence_axis is None:
        return entry(plan, query, key, value, **options)
    key, value, shard = _whole_sequence(plan, query, key, value, sequence_axis, options)
    return entry(plan, query, key, value, **shard, **options)


def _whole_sequence(plan: p.Plan, query, key, value, sequence_axis: AxisName, options: dict):
    """What a query shard of the sequence axis attends with: the keys and values of every shard,
    its first row, and, where a top-k group may straddle shards (per block(Q) on packed
    sequences), every shard's queries to score from (without gradient: top-k is not differentiated)."""
    key, value = (lax.all_gather(x, sequence_axis, axis=1, tiled=True) for x in (key, value))
    shard = {"query_offset": lax.axis_index(sequence_axis) * query.shape[1]}
    if dispatch.needs_scoring_query(plan, options.get("cu_seqlens")):
        shard["scoring_query"] = lax.all_gather(lax.stop_gradient(query), sequence_axis, axis=1, tiled=True)
    return key, value, shard


# SparseAttention's arguments for a shard of the queries against a key/value cache. A
# ShardedAttention shards whole sequences itself, so it has no place for them; its **extra_gates
# would take them for gates and the validation blame a gate name or the keys' length.
_DECODING_ARGUMENTS = ("query_offset", "scoring_query", "compressed")


_WHOLE_SEQUENCES = "a ShardedAttention attends whole sequences (context parallelism places each shard's queries itself)"


def _refuse_decoding_arguments(given: Mapping[str, object], why: str = _WHOLE_SEQUENCES) -> None:
    for name in _DECODING_ARGUMENTS:
        if given.get(name) is not None:
            raise ValueError(
                f"{name}: {why}; to decode against a cache with the batch or the heads sharded, call the "
                f"SparseAttention with {name}= inside your own jax.shard_map (it needs no communication)"
            )


def _names(axis: AxisName) -> tuple[str, ...]:
    return () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)


def _explicit_spec(array) -> tuple[object, tuple[AxisName, ...]] | None:
    """(mesh, the Explicit mesh axes of each dimension) of an array typed with a sharding along
    Explicit axes; None for any other value (Auto or Manual axes, a replicated array, a number)."""
    if not isinstance(array, jax.Array):  # tracers included
        return None
    sharding = getattr(jax.typeof(array), "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = _explicit_axes(sharding.mesh, sharding.spec)
    return (sharding.mesh, spec) if any(spec) else None


def _explicit_axes(mesh, spec) -> tuple[AxisName, ...]:
    """Each dimension's axes of `spec` that are Explicit in `mesh` (None where there are none)."""
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    return tuple(tuple(n for n in _names(axis) if n in explicit) or None for axis in spec)


def on_explicit_axes(*arrays) -> bool:
    """Whether any of `arrays` is sharded along Explicit mesh axes."""
    return any(_explicit_spec(x) is not None for x in arrays)


def following_placement(plan: p.Plan, config: NativeSparseAttentionConfig | None, query, *others, given: Mapping[str, object]):
    """The ShardedAttention that runs a call where its arrays lie, when any of them (the query or
    `others`) is sharded along Explicit mesh axes (jax.make_mesh's default, under jax.set_mesh):
    its batch, sequence and heads shard as the query's are (the others are moved to match;
    a sharded sequence is context parallel). None for every other call, which runs as given.

    Plain calls cannot take such arrays: JAX refuses the kernels' data-dependent gathers and
    reshapes on them (ShardingTypeError), and a mesh whose axes are Auto leaves the partitioning
    to XLA, which replicates the work (see the README's shard_map section). `given`: the call's
    other arguments by name, so that those a ShardedAttention has no place for are refused."""
    found = [s for s in map(_explicit_spec, (query, *others)) if s is not None]
    if not found:
        return None
    _refuse_decoding_arguments(given, "this call's arrays are sharded along Explicit mesh axes, so it runs in "
                                      "jax.shard_map over whole sequences")
    mesh, spec = found[0]  # the query's, where it is sharded; JAX puts every argument of a call on one mesh
    batch, sequence, heads = (*spec, None, None, None)[:3] if _explicit_spec(query) is not None else (None,) * 3
    return ShardedAttention(plan, config, mesh, batch_axis=batch, head_axis=heads, sequence_axis=sequence)


@dataclass(frozen=True)
class ShardedAttention:
    """A pattern's attention over a device mesh (see the module's docstring).

    Call it like SparseAttention, on global arrays: it validates them, builds the shard_map
    with the PartitionSpecs below and returns the global output (sharded like the queries).
    Inside your own `jax.shard_map`, call `per_shard` on the local blocks instead (it needs
    only the sequence axis' name; `spec` and `gate_spec` are the PartitionSpecs to use).

    mesh: the devices; None uses the mesh set with `jax.set_mesh` at call time.
    batch_axis, head_axis, sequence_axis: mesh axis names (or tuples of them) that shard the
    batch, the heads and the sequence; None leaves that dimension whole.
    """

    plan: p.Plan
    config: NativeSparseAttentionConfig | None = None
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None
    batch_axis: AxisName = None
    head_axis: AxisName = None
    sequence_axis: AxisName = None

    def __post_init__(self) -> None:
        seen: list[str] = []
        for argument in ("batch_axis", "head_axis", "sequence_axis"):
            axis = getattr(self, argument)
            names = _names(axis)
            if axis is not None and (not names or not all(isinstance(n, str) for n in names)):
                raise ValueError(f"{argument} must be a mesh axis name, a tuple of them, or None; got {axis!r}")
            if isinstance(axis, list):
                object.__setattr__(self, argument, tuple(axis))  # hashable, like PartitionSpec entries
            for name in names:
                if name in seen:
                    raise ValueError(f"{argument}: mesh axis {name!r} already shards another dimension")
                seen.append(name)
        if self.mesh is not None:
            self._check_names(self.mesh)

    @property
    def spec(self) -> P:
        """PartitionSpec of q, k, v, the output and block_indices ([B, T, H, ...])."""
        return P(self.batch_axis, self.sequence_axis, self.head_axis, None)

    @property
    def gate_spec(self) -> P:
        """PartitionSpec of gates and block_counts ([B, T, H])."""
        return P(self.batch_axis, self.sequence_axis, self.head_axis)

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
        **extra_gates,
    ):
        """Sparse attention of the pattern on global arrays (SparseAttention's arguments):
        query [B, T, HQ, D], key/value [B, T, HKV, D], gates [B, T, HQ], block_indices
        [B, T, HKV, S], block_counts int or [B, T, HKV], cu_seqlens [N + 1] (B == 1) ->
        [B, T, HQ, D] sharded by `spec`. jit- and grad-safe."""
        _refuse_decoding_arguments(extra_gates)
        gates = {"g_cmp": g_cmp, "g_slc": g_slc, "g_swa": g_swa, **extra_gates}
        given = dispatch.inputs(self.plan, query, key, value, gates=gates, cu_seqlens=cu_seqlens,
                                softmax_scale=softmax_scale, block_indices=block_indices, block_counts=block_counts)
        args = {"query": given.query, "key": given.key, "value": given.value, "gates": given.gates}
        if given.block_indices is not None:
            args.update(block_indices=given.block_indices, block_counts=given.block_counts)
        return self._run("attention", given, args, platform, pool_fns)

    def selections(self, query, key, value, *, cu_seqlens=None, softmax_scale=None, platform: str | None = None,
                   pool_fns=None):
        """The key blocks each topk branch selects, on global arrays: {branch name:
        [B, T, HKV, min(count, ceil(T / block))] block ids, -1 unused}, sharded by `spec`."""
        if not any(isinstance(b, p.TopKBranch) for b in self.plan.branches):
            raise ValueError(f"pattern {self.plan.name!r} has no topk branch")
        query, key, value, shapes = validate.attention_inputs(query, key, value)
        cu, scale = validate.cu_seqlens(cu_seqlens, shapes), validate.softmax_scale(softmax_scale, shapes)
        given = dispatch.Inputs(query, key, value, shapes, {}, cu, scale, None, None)
        args = {"query": given.query, "key": given.key, "value": given.value}
        return self._run("selections", given, args, platform, pool_fns)

    def per_shard(
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
        **extra_gates,
    ):
        """The attention of one device's blocks, inside your own `jax.shard_map` over a mesh
        with this object's axis names, the arguments partitioned by `spec` / `gate_spec`
        (cu_seqlens and softmax_scale replicated). Returns this device's output block."""
        _refuse_decoding_arguments(extra_gates)
        gates = {"g_cmp": g_cmp, "g_slc": g_slc, "g_swa": g_swa, **extra_gates}
        return attend_shard(
            self.plan, query, key, value, sequence_axis=self.sequence_axis, gates=gates, cu_seqlens=cu_seqlens,
            softmax_scale=softmax_scale, block_indices=block_indices, block_counts=block_counts, platform=platform,
            config=self.config, pool_fns=pool_fns,
        )

    # ---- building the shard_map -------------------------------------------------------------

    def _check_names(self, mesh) -> None:
        for argument in ("batch_axis", "head_axis", "sequence_axis"):
            for name in _names(getattr(self, argument)):
                if name not in mesh.axis_names:
                    raise ValueError(f"{argument}: the mesh has no axis {name!r} (its axes: {', '.join(mesh.axis_names)})")

    def _mesh(self):
        mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError("mesh: pass a jax.sharding.Mesh to sharded(), or call under `with jax.set_mesh(mesh):`")
        self._check_names(mesh)
        return mesh

    def _sizes(self, mesh, given: dispatch.Inputs) -> tuple[int, int, int]:
        """Devices along the batch, head and sequence axes, once the shapes are checked against them."""
        batch, heads, sequence = (
            math.prod(mesh.shape[n] for n in _names(axis)) for axis in (self.batch_axis, self.head_axis, self.sequence_axis)
        )
        shapes = given.shapes
        if shapes.batch % batch:
            packed = " (cu_seqlens packs sequences into a single batch row: shard them along the sequence instead)"
            raise ValueError(
                f"query: batch {shapes.batch} is not divisible by the {batch} devices of batch_axis "
                f"{self.batch_axis!r}{packed if given.cu_seqlens is not None else ''}"
            )
        if shapes.heads_kv % heads:
            raise ValueError(
                f"key: num_kv_heads {shapes.heads_kv} is not divisible by the {heads} devices of head_axis "
                f"{self.head_axis!r}; query heads are sharded with their KV head so that no group of "
                f"{shapes.heads_q // shapes.heads_kv} query heads is split"
            )
        grouped = dispatch.grouped_topk(self.plan) is not None
        rows = sequence * self.plan.block_size if grouped else sequence
        if sequence > 1 and shapes.seq_len % rows:
            whole_blocks = f" times the pattern's block ({self.plan.block_size}): its top-k scores whole groups"
            raise ValueError(
                f"query: seq_len {shapes.seq_len} must be divisible by the {sequence} devices of sequence_axis "
                f"{self.sequence_axis!r}{whole_blocks if grouped else ''}"
            )
        return batch, heads, sequence

    def _run(self, entry: str, given: dispatch.Inputs, args: dict, platform: str | None, pool_fns):
        mesh = self._mesh()
        sequence = self._sizes(mesh, given)[2]
        platform = dispatch.choose_platform(self.plan, platform, self.config, query_shard=sequence > 1)
        scale = given.softmax_scale
        if not isinstance(scale, float):  # an array, maybe traced: an argument, replicated
            args["softmax_scale"], scale = scale, None
        if given.cu_seqlens is not None:
            args["cu_seqlens"] = given.cu_seqlens
        layout = (entry, platform, scale, tuple(sorted(args)))
        if pool_fns:  # they close over parameters: traced along by the caller's jit, never cached
            return self._mapped(mesh, layout, sequence > 1, pool_fns)(args)
        return _jitted(self, mesh, layout, sequence > 1)(args)

    def _mapped(self, mesh, layout, context_parallel: bool, pool_fns=None) -> Callable:
        """shard_map of the per-shard entry over `mesh` for arguments {name: array} of `layout`."""
        entry, platform, scale, names = layout
        specs = {
            "query": self.spec, "key": self.spec, "value": self.spec, "block_indices": self.spec,
            "gates": self.gate_spec, "block_counts": self.gate_spec, "cu_seqlens": P(), "softmax_scale": P(),
        }
        in_specs = {name: specs[name] for name in names}
        out_specs = self.spec
        if entry == "selections":
            out_specs = {b.name: self.spec for b in self.plan.branches if isinstance(b, p.TopKBranch)}
        sequence_axis = self.sequence_axis if context_parallel else None

        def per_device(args: Mapping[str, jax.Array]):
            options = dict(args)
            query, key, value = options.pop("query"), options.pop("key"), options.pop("value")
            options.setdefault("softmax_scale", scale)
            options.update(platform=platform, config=self.config, pool_fns=pool_fns, sequence_axis=sequence_axis)
            shard_entry = attend_shard if entry == "attention" else selections_shard
            return shard_entry(self.plan, query, key, value, **options)

        # Pallas' interpreter cannot run a kernel on values typed with manual axes (jax 0.10: "Scan
        # carry input and output got mismatched varying manual axes"): its kernels run unchecked.
        mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs,
                               check_vma=platform != "pallas")
        if AxisType.Explicit not in mesh.axis_types:
            return mapped  # shard_map moves inputs of Auto axes where in_specs say

        def placed(args):  # arguments on Explicit axes must already be where in_specs say
            def move(x, spec):
                return jax.sharding.reshard(x, NamedSharding(mesh, P(*_explicit_axes(mesh, spec))))

            moved = jax.tree.map(lambda spec, arg: jax.tree.map(lambda x: move(x, spec), arg), in_specs, args,
                                 is_leaf=lambda x: isinstance(x, P))
            return mapped(moved)

        return placed


@functools.lru_cache(maxsize=64)
def _jitted(sharded: ShardedAttention, mesh, layout, context_parallel: bool) -> Callable:
    return jax.jit(sharded._mapped(mesh, layout, context_parallel))


def sharded_native_sparse_attention(mesh=None, *, batch_axis: AxisName = None, head_axis: AxisName = None,
                                    sequence_axis: AxisName = None, block_size: int = 64) -> Callable:
    """ejkernel's `native_sparse_attention` over a mesh (the axes as ShardedAttention's): returns
    fn(query, key, value, g_cmp=None, g_slc=None, block_indices=None, block_counts=16,
    cu_seqlens=None, /, *, softmax_scale=None, platform=None, cfg=None) on global arrays.

    cfg None, "autotune" or "heuristic" is chosen by the Kernel interface (nsa_dsl.kernel) for
    one shard's arguments -- an Invocation with method="shard_map", whose candidates are
    candidate_cfgs_shard_map_* -- and a NativeSparseAttentionConfig is used as given. With the
    sequence sharded, the automatic platform is one that runs a shard of the queries."""
    from .kernel import NativeSparseAttention, nsa_plan  # the Kernel interface is built on the runtime

    kernel = NativeSparseAttention(block_size)

    def attention(query, key, value, g_cmp=None, g_slc=None, block_indices=None, block_counts=16, cu_seqlens=None, /,
                  *, softmax_scale=None, platform: str | None = None, cfg=None):
        given_cfg = cfg is not None and not isinstance(cfg, str)
        if given_cfg:
            cfg = NativeSparseAttentionConfig.of(cfg, "cfg", "'autotune', 'heuristic' or None")
        plan = nsa_plan(cfg.block_size if given_cfg else kernel.block_size, g_cmp, block_indices, block_counts)
        selection = {} if g_cmp is not None else {"block_indices": block_indices, "block_counts": block_counts}
        if g_cmp is not None and block_indices is not None:
            warnings.warn("native_sparse_attention: block_indices are ignored when g_cmp is given (top-k selects the blocks)",
                          stacklevel=2)
        layer = ShardedAttention(plan, None, mesh, batch_axis, head_axis, sequence_axis)
        if not given_cfg:
            given = dispatch.inputs(plan, query, key, value, gates={"g_cmp": g_cmp, "g_slc": g_slc}, cu_seqlens=cu_seqlens,
                                    softmax_scale=softmax_scale, **selection)
            batch, heads, sequence = layer._sizes(layer._mesh(), given)
            platform = dispatch.choose_platform(plan, platform, None, query_shard=sequence > 1)

            def one_shard(x):  # [B, T, H, ...] -> one device's block, abstract
                if x is None:
                    return None
                shape = (x.shape[0] // batch, x.shape[1] // sequence, x.shape[2] // heads, *x.shape[3:])
                return jax.ShapeDtypeStruct(shape, x.dtype)

            counts = block_counts if g_cmp is not None else one_shard(given.block_counts)
            cu = None if given.cu_seqlens is None else jax.ShapeDtypeStruct(given.cu_seqlens.shape, given.cu_seqlens.dtype)
            invocation = kernel.invocation(
                one_shard(given.query), one_shard(given.key), one_shard(given.value), one_shard(given.gates.get("g_cmp")),
                one_shard(given.gates.get("g_slc")), one_shard(given.block_indices), counts, given.softmax_scale, cu,
                platform, method="shard_map",
            )
            cfg = kernel.choose_cfg(invocation, cfg)
        return replace(layer, config=cfg)(query, key, value, g_cmp=g_cmp, g_slc=g_slc, cu_seqlens=cu_seqlens,
                                          softmax_scale=softmax_scale, platform=platform, **selection)

    return attention
