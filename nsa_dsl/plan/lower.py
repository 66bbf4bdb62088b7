"""Lowering a checked pattern to a plan."""

from __future__ import annotations

from ..dsl import model
from ..errors import NsaSemanticError
from . import plan as p
from .ranges import MAX_TOKENS, clamped_atom


def lower(pattern: model.Pattern) -> p.Plan:
    return p.Plan(
        name=pattern.name,
        block_size=pattern.block_size,
        causal=pattern.causal,
        params=pattern.params,
        branches=tuple(_lower_branch(b) for b in pattern.branches),
        idle_gates=pattern.idle_gates,
    )


def _lower_branch(branch: model.Branch) -> p.BranchPlan:
    match branch.keys:
        case model.Compress(block, stride, pool):
            return p.CompressBranch(branch.name, branch.gate, block, stride, pool)
        case model.TopK(count, block, score, force):
            forced = None if force is None else lower_keys(force)
            return p.TopKBranch(branch.name, branch.gate, count, block, score, branch.query_block, forced)
        case keys:
            return p.StaticBranch(branch.name, branch.gate, lower_keys(keys))


def lower_keys(keys: model.KeySet) -> p.StaticKeys:
    """Number the block atoms (equal atoms share a bit) and rewrite the key set over them."""
    atoms: list[model.BlockAtom] = []
    keys = _clamped(keys)

    def rewrite(node: model.KeySet) -> p.MaskExpr:
        match node:
            case model.Window(left, right):
                return p.TokenWindow(left, right)
            case model.Union(parts):
                return p.AnyOf(tuple(rewrite(x) for x in parts))
            case model.Intersection(parts):
                return p.AllOf(tuple(rewrite(x) for x in parts))
            case model.Difference(left, right):
                return p.Without(rewrite(left), rewrite(right))
            case model.Local() | model.Stride() | model.Global() | model.Blocks() | model.Random():
                if node not in atoms:
                    atoms.append(node)
                return p.AtomBit(atoms.index(node))
        raise TypeError(f"not a static key set: {node!r}")

    mask = rewrite(keys)
    if len(atoms) > model.MAX_BLOCK_ATOMS:  # dsl.check refuses these in a pattern; key sets built by hand may hold them
        raise NsaSemanticError(
            f"a key set may use at most {model.MAX_BLOCK_ATOMS} distinct block atoms, this one uses {len(atoms)}"
        )
    return p.StaticKeys(keys=keys, block_atoms=tuple(atoms), mask=mask)


def _clamped(keys: model.KeySet) -> model.KeySet:
    """`keys` with its atoms' extents cut as the range kernels cut them (ranges.clamped_atom; the
    block size is not known here, so by MAX_TOKENS blocks): tables and token masks then keep
    position + extent within int32 (window(1, 2**31 - 1) wrapped to negative positions and saw
    nothing)."""
    match keys:
        case model.Union(parts) | model.Intersection(parts):
            return type(keys)(tuple(_clamped(x) for x in parts))
        case model.Difference(left, right):
            return model.Difference(_clamped(left), _clamped(right))
    return clamped_atom(keys, MAX_TOKENS)
