"""`nsa-compile`: compile the patterns of a `.nsa` file to importable kernel modules.

    nsa-compile FILE.nsa [-D name=value ...] [--pattern NAME] [--platform xla[,triton][,pallas]]
                [--device cpu|gpu|tpu] [-o DIR] [--show-plan] [--check] [--seq-len T]

For every pattern and platform it writes DIR/<pattern>_<platform>.py and prints a summary:
the branches, and for static branches at --seq-len the key blocks per query row, the density
(visited tiles over the tiles causality allows) and the share of full (unmasked) tiles.
Bad input prints the located error, without a traceback, and exits 1; bad usage exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import codegen, dsl
from .api import check_pattern
from .codegen.cache import holds_entry, write_atomically
from .config import PLATFORMS, NativeSparseAttentionConfig
from .dsl import model
from .errors import NsaError
from .plan import build_block_table, lower
from .plan import plan as p
from .plan.ranges import MAX_TOKENS
from .resources import templates_dir
from .runtime import check_supported
from .runtime.platform import for_device, has_generator


def _define(text: str) -> tuple[str, str]:
    """`-D name=value`; the language parses the value as the param's declared type."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected name=value, got {text!r}")
    return name, value.strip()


def _seq_len(text: str) -> int:
    """A sequence length the kernels run: their int32 positions plus a pattern's (clamped)
    extents stay in range up to MAX_TOKENS, and longer ones overflow the statistics' tables."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"expected a positive int up to 2**29 = {MAX_TOKENS}, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nsa-compile", description="Compile the sparse-attention patterns of a .nsa file to kernel modules."
    )
    parser.add_argument("file", type=Path, help="the .nsa file")
    parser.add_argument(
        "-D",
        dest="defines",
        metavar="NAME=VALUE",
        type=_define,
        action="append",
        default=[],
        help="override a param of the patterns (repeatable)",
    )
    parser.add_argument("--pattern", metavar="NAME", help="compile only this pattern of the file")
    parser.add_argument(
        "--platform", default="xla", help=f"comma-separated platforms out of {','.join(PLATFORMS)} (default: xla)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "gpu", "tpu"),
        help="the device kind the modules are for (default: this machine's; Pallas renders a GPU or a TPU variant)",
    )
    parser.add_argument(
        "-o", "--output", type=Path, default=Path("."), metavar="DIR", help="where to write the modules (default: .)"
    )
    parser.add_argument("--show-plan", action="store_true", help="print each pattern's plan")
    parser.add_argument(
        "--check", action="store_true", help="run the generated kernels against the float64 reference on random data"
    )
    parser.add_argument(
        "--seq-len",
        type=_seq_len,
        default=8192,
        metavar="T",
        help="sequence length for the summary's statistics and --check (default: 8192)",
    )
    return parser


def _platforms(parser: argparse.ArgumentParser, text: str) -> list[str]:
    platforms = [name.strip() for name in text.split(",") if name.strip()]
    if not platforms:
        parser.error("--platform names no platform")
    for name in platforms:
        if name not in PLATFORMS:
            parser.error(f"unknown platform {name!r}; choose from {', '.join(PLATFORMS)}")
        if not has_generator(name):
            parser.error(f"platform {name!r} has no code generator yet (no {name}/module.py.j2 in {templates_dir()})")
    return list(dict.fromkeys(platforms))


# ---- readable descriptions ---------------------------------------------------------------
def _describe(node: model.KeySet | p.MaskExpr) -> str:
    """A key set or token mask written back in the language's own notation."""
    match node:
        case model.Window(left, right) | p.TokenWindow(left, right):
            return f"window({left}, {right})" if right else f"window({left})"
        case model.Local(before, after):
            return f"local({before}, {after})" if after else f"local({before})"
        case model.Stride(every, offset):
            return f"stride(every={every}, offset={offset})" if offset else f"stride(every={every})"
        case model.Global(first):
            return f"global(first={first})"
        case model.Blocks(ids):
            return f"blocks({', '.join(map(str, ids))})"
        case model.Random(count, seed):
            return f"random({count}, seed={seed})"
        case p.AtomBit(index):
            return f"atom{index}"
        case model.Union(parts) | p.AnyOf(parts):
            return " | ".join(_operand(x) for x in parts)
        case model.Intersection(parts) | p.AllOf(parts):
            return " & ".join(_operand(x) for x in parts)
        case model.Difference(left, right) | p.Without(left, right):
            return f"{_operand(left)} - {_operand(right)}"
    raise TypeError(f"not a key set or mask: {node!r}")


def _operand(node: model.KeySet | p.MaskExpr) -> str:
    compound = (model.Union, model.Intersection, model.Difference, p.AnyOf, p.AllOf, p.Without)
    return f"({_describe(node)})" if isinstance(node, compound) else _describe(node)


def _gate(gate: model.Gate | None) -> str:
    if gate is None:
        return "no gate"
    return f"gate {gate.name}" + ("" if gate.default is None else f", default {gate.default}")


def _kind(branch: p.BranchPlan) -> str:
    match branch:
        case p.StaticBranch(static=static):
            return f"static {_describe(static.keys)}"
        case p.CompressBranch(block=block, stride=stride, pool=pool):
            return f"compress(block={block}, stride={stride}, pool={pool})"
        case p.TopKBranch(count=count, block=block, score=score, query_block=query_block, force=force):
            per = "per token" if query_block == 1 else f"per block({query_block})"
            forced = "" if force is None else f", force={_describe(force.keys)}"
            return f"topk({count}, block={block}, score={score}{forced}) {per}"
        case p.SelectBranch(block=block):
            return f"explicit block_indices over blocks of {block}"
    raise TypeError(f"not a branch plan: {branch!r}")


def _lowered(branch: p.BranchPlan) -> list[str]:
    """The block atoms and token mask a static key set was lowered to (--show-plan)."""
    match branch:
        case p.StaticBranch(static=static) | p.TopKBranch(force=static) if static is not None:
            atoms = [f"    atom{index} = {_describe(atom)}" for index, atom in enumerate(static.block_atoms)]
            return atoms + [f"    token mask on partial tiles: {_describe(static.mask)}"]
    return []


def table_statistics(plan: p.Plan, static: p.StaticKeys, seq_len: int) -> str:
    table = build_block_table(static, plan.block_size, plan.causal, seq_len)
    rows = table.num_query_blocks
    visited = int(table.counts.sum())
    # Tiles a dense kernel would visit: the lower triangle when causal, all of them otherwise.
    reachable = rows * (rows + 1) // 2 if plan.causal else rows * table.num_key_blocks
    valid = np.arange(table.width) < table.counts[:, None]
    full = int((table.full & valid).sum())
    return (
        f"{visited / rows:.1f} key blocks per query row (max {int(table.counts.max())}), "
        f"density {visited / reachable:.2%} of {'causal' if plan.causal else 'all'} tiles, "
        f"{full / max(visited, 1):.0%} of visited tiles full"
    )


def summary(plan: p.Plan, seq_len: int, *, show_plan: bool = False) -> str:
    # values in the language's spelling: true/false, not Python's True/False
    shown = (f"{name}={str(value).lower() if isinstance(value, bool) else value}" for name, value in plan.params)
    params = ", ".join(shown) or "none"
    lines = [
        f"pattern {plan.name}: block {plan.block_size}, {'causal' if plan.causal else 'bidirectional'}, params {params}"
    ]
    for branch in plan.branches:
        lines.append(f"  branch {branch.name} ({_gate(branch.gate)}): {_kind(branch)}")
        if show_plan:
            lines += _lowered(branch)
        if isinstance(branch, p.StaticBranch):
            lines.append(f"    at T={seq_len}: {table_statistics(plan, branch.static, seq_len)}")
    return "\n".join(lines)


# Modules a generated module must never be named after, installed here or not: installed later (the
# gpu extra brings jax_triton), a module beside them would hide them from scripts run in its folder.
_RESERVED_MODULES = frozenset(sys.stdlib_module_names) | {
    "absl", "jax", "jax_triton", "jaxlib", "jinja2", "lark", "ml_dtypes", "nsa_dsl", "numpy", "torch", "triton"
}


def _importable_elsewhere(module: str, target: Path) -> str | None:
    """Where a module named `module` is importable from, unless it is `target` itself (a module an
    earlier run wrote there): a pattern named jax compiled for Triton would write jax_triton.py."""
    if module in _RESERVED_MODULES:
        return "a module nsa_dsl or its dependencies use"
    importlib.invalidate_caches()  # the finders cache folder listings
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package that fails to import, a module without a spec
        return None
    if spec is None or (spec.origin is not None and Path(spec.origin).resolve() == target.resolve()):
        return None
    return spec.origin or "a namespace package"


# ---- the command -------------------------------------------------------------------------
def _say(text: str) -> None:
    """Print a line of the summary. A reader that stopped reading (`nsa-compile ... | head -1`) stops
    the output, not the modules' writing: the rest of the output goes nowhere."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _check(plan: p.Plan, platform: str, seq_len: int) -> bool:
    report = check_pattern(plan, seq_len, platform=platform)
    _say(f"  check {platform}: {report}")
    return bool(report.ok)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    platforms = _platforms(parser, args.platform)
    try:
        return _compile(args, platforms)
    except NsaError as err:
        print(err, file=sys.stderr)
        return 1
    except OSError as err:  # the output folder cannot be written (reading errors are NsaErrors)
        where = f": {err.filename}" if err.filename else ""
        print(f"nsa-compile: {err.strerror or err}{where}", file=sys.stderr)
        return 1
    except MemoryError:  # a dense table at a long --seq-len (the summary's; the kernels build theirs per call)
        print(f"nsa-compile: not enough memory for the block tables' statistics at --seq-len {args.seq_len}: "
              "give a shorter one", file=sys.stderr)
        return 1


def _compile(args: argparse.Namespace, platforms: list[str]) -> int:
    overrides = dict(args.defines)
    if args.pattern is None:
        patterns = dsl.load(args.file, overrides=overrides)
    else:
        patterns = (dsl.load_pattern(args.file, name=args.pattern, overrides=overrides),)
    plans = [lower(pattern) for pattern in patterns]
    # as calls render them, so the entry it reports is the one a call with the default config loads
    config = for_device(NativeSparseAttentionConfig(backend=args.device))
    args.output.mkdir(parents=True, exist_ok=True)
    succeeded = True
    for plan in plans:
        _say(summary(plan, args.seq_len, show_plan=args.show_plan))
        for platform in platforms:
            try:
                check_supported(plan, platform)
            except NotImplementedError as err:  # a module missing a branch's kernel is no module
                print(f"nsa-compile: not generated: {err}", file=sys.stderr)
                succeeded = False
                continue
            module = f"{plan.name}_{platform}"
            target = args.output / f"{module}.py"
            shadowed = _importable_elsewhere(module, target)
            if shadowed is not None:  # imported from its folder, it would hide that module (or be hidden by it)
                print(f"nsa-compile: not generated: {target} would shadow the importable module {module} ({shadowed}); "
                      f"rename pattern {plan.name!r}", file=sys.stderr)
                succeeded = False
                continue
            # Replaced whole or not at all: a write that fails midway (a full disk) keeps the earlier module.
            # Through a symbolic link, as writing to it would: the link stays, its file is replaced.
            try:
                write_atomically(target.resolve(), codegen.source(platform, plan, config).encode())
            except OSError as err:  # named by the module, not by the temporary file it was written to
                raise OSError(err.errno, err.strerror, str(target)) from err
            entry = codegen.cache_path(platform, plan, config)
            # A cache that could not take the entry has warned; its path then holds nothing, or a damaged
            # entry that it could not replace.
            cached = f"cached at {entry}" if holds_entry(entry) else f"not cached: {codegen.cache_root()} cannot take it"
            _say(f"  {platform}: wrote {target} ({cached})")
            if args.check:
                succeeded &= _check(plan, platform, args.seq_len)
    return 0 if succeeded else 1


if __name__ == "__main__":
    sys.exit(main())
