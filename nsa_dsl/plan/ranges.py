"""Static key sets whose keys are ranges computed from the query position.

For many patterns the keys a query at position t sees are a few ranges whose ends follow from
t and the pattern's constants alone. A kernel then computes a query tile's key ranges itself
(no index table), and knows which of its key tiles every query of the tile sees (no mask).
`KeyRanges` is that form; `key_ranges` finds it for a branch's key set, or says there is none
(the branch keeps its block table: random draws, explicit blocks, intersections, differences).

A key set of this form is the union of, for the query at position t of block qb = t // block:

  prefix       the first key blocks: global(first=n);
  window       keys (t - left, t + right];
  local        key blocks (qb - before, qb + after];
  progression  key blocks offset, offset + every, ... (stride(every, offset), every > 1);

or every key of the sequence (stride(1), and any part that reaches past every sequence).
Each range's ends are nondecreasing in t, so the keys some query of a tile [t0, t1] sees are
[lo(t0), hi(t1)) and those every query sees [lo(t1), hi(t0)). That needs the union of the
window and the local range to be one range for every t: both hold t (left >= 1, before >= 1),
or only one of them is present. Windows merge (two windows holding t are the widest one), so
do locals; two progressions do not (their blocks may coincide), so such a set keeps the table.
Causality and sequence bounds are the kernels' business, as everywhere.

Extents are clamped to MAX_TOKENS, beyond any sequence a kernel runs, so that a kernel's int32
position arithmetic never overflows (window(2147483647) is fine and means every earlier key).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dsl.model import MAX_TOKENS, Global, KeySet, Local, Stride, Union, Window
from .plan import Plan, StaticBranch, StaticKeys, TopKBranch

# A range launch whose queries see at most this many keys (beyond a global prefix) is "near".
NEAR_KEYS = 2048


@dataclass(frozen=True)
class KeyRanges:
    """A static key set as ranges of keys computed from the query position (see the module),
    extents clamped to MAX_TOKENS."""

    everything: bool  # every key of the sequence; nothing else is set then
    prefix_blocks: int  # global(first=n): key blocks [0, n); 0 when there is none
    window: Window | None
    local: Local | None
    progression: Stride | None

    @property
    def sliding(self) -> bool:
        """Whether a window or local range moves with the query."""
        return self.window is not None or self.local is not None

    def reach(self, block_size: int) -> int:
        """Keys a query sees at most beyond the global prefix (MAX_TOKENS: unbounded)."""
        if self.everything or self.progression is not None:
            return MAX_TOKENS
        window = self.window.left + self.window.right if self.window is not None else 0
        local = (self.local.before + self.local.after) * block_size if self.local is not None else 0
        return max(window, local)


EVERY_KEY = KeyRanges(True, 0, None, None, None)


def key_ranges(static: StaticKeys, block_size: int, causal: bool) -> KeyRanges | None:
    """The range form of a static key set, or None where it has none (it keeps its table)."""
    parts = _union_parts(static.keys)
    if parts is None:
        return None
    blocks = MAX_TOKENS // block_size  # more key blocks than any sequence has
    parts = [clamped_atom(part, blocks) for part in parts]
    if any(_every_key(part, blocks, causal) for part in parts):
        return EVERY_KEY
    windows = [x for x in parts if isinstance(x, Window)]
    locals_ = [x for x in parts if isinstance(x, Local)]
    globals_ = [x for x in parts if isinstance(x, Global)]
    strides = list(dict.fromkeys(x for x in parts if isinstance(x, Stride)))
    if len(strides) > 1:
        return None
    if len(windows) + len(locals_) > 1 and not (
        all(w.left >= 1 for w in windows) and all(x.before >= 1 for x in locals_)
    ):
        return None  # ranges that do not hold t may leave a gap between them
    return KeyRanges(
        everything=False,
        prefix_blocks=max((g.first for g in globals_), default=0),
        window=Window(max(w.left for w in windows), max(w.right for w in windows)) if windows else None,
        local=Local(max(x.before for x in locals_), max(x.after for x in locals_)) if locals_ else None,
        progression=strides[0] if strides else None,
    )


def _union_parts(keys: KeySet) -> list[KeySet] | None:
    """The atoms of a key set that is a (nested) union of window, local, global and stride
    atoms; None for any other key set."""
    if isinstance(keys, Union):
        parts = [_union_parts(x) for x in keys.parts]
        return None if any(p is None for p in parts) else [atom for p in parts for atom in p]
    if isinstance(keys, (Window, Local, Global, Stride)):
        return [keys]
    return None


def clamped_atom(part: KeySet, blocks: int) -> KeySet:
    """`part` with extents past MAX_TOKENS (`blocks` key blocks) cut to it: the same keys in
    every sequence a kernel runs, and a position plus an extent within int32. Other atoms as
    they are."""
    match part:
        case Window(left, right):
            return Window(min(left, MAX_TOKENS), min(right, MAX_TOKENS))
        case Local(before, after):
            return Local(min(before, blocks), min(after, blocks))
        case Global(first):
            return Global(min(first, blocks))
        case Stride(every, offset):  # past `blocks`, a progression has no further member in a sequence
            return Stride(min(every, blocks), min(offset, blocks))
    return part


def _every_key(part: KeySet, blocks: int, causal: bool) -> bool:
    """Whether a clamped atom holds every key a query of any sequence may see."""
    match part:
        case Window(left, right):
            return left == MAX_TOKENS and (causal or right == MAX_TOKENS)
        case Local(before, after):
            return before == blocks and (causal or after == blocks)
        case Global(first):
            return first == blocks
        case Stride(every, _):
            return every == 1  # offset < every
    return False


@dataclass(frozen=True)
class StaticLaunch:
    """Static branches that run in one kernel launch: several only when every one has the
    range form (`ranges` is then one KeyRanges per branch); one branch with `ranges` None
    keeps its block table."""

    branches: tuple[StaticBranch, ...]
    ranges: tuple[KeyRanges, ...] | None

    @property
    def name(self) -> str:
        """The launch's name in generated code (a suffix of its kernels' names): "ranges" for
        the launch of the range-form branches (a plan has one at most), "table_<branch>" for a
        branch over its table, so no two launches share one (the branches' names joined by "_"
        did: a and b fused against a table branch a_b)."""
        return "ranges" if self.ranges is not None else f"table_{self.branches[0].name}"

    @property
    def fused(self) -> bool:
        return len(self.branches) > 1

    def reach(self, block_size: int) -> int:
        """Keys a query sees at most beyond the global prefix, in any of the launch's branches
        (MAX_TOKENS: unbounded, or a launch over a table)."""
        return max(r.reach(block_size) for r in self.ranges) if self.ranges is not None else MAX_TOKENS

    def near(self, block_size: int) -> bool:
        """Whether every query sees few keys (NEAR_KEYS at most, beyond a global prefix): such a
        launch is bound by loads more than by arithmetic, and its kernels take tiles of several
        heads sharing each key tile instead of long query tiles (measured on an H200)."""
        return self.reach(block_size) <= NEAR_KEYS


def static_launches(plan: Plan) -> tuple[StaticLaunch, ...]:
    """How a plan's static branches run: those of range form in one launch (sharing each query
    tile, the gates applied as the output is written), every other alone over its table."""
    static = [b for b in plan.branches if isinstance(b, StaticBranch)]
    forms = {b.name: key_ranges(b.static, plan.block_size, plan.causal) for b in static}
    ranged = tuple(b for b in static if forms[b.name] is not None)
    launches = [StaticLaunch(ranged, tuple(forms[b.name] for b in ranged))] if ranged else []
    launches += [StaticLaunch((b,), None) for b in static if forms[b.name] is None]
    return tuple(launches)


def trailing_window(launch: StaticLaunch, causal: bool) -> int | None:
    """w when `launch` is one branch of a causal pattern whose query at position t sees exactly the
    keys (t - w, t] of its sequence (MAX_TOKENS: every key up to t; plain `causal` and sliding
    windows); None for any other launch. The GPU module has Hopper kernels (forward, backward) for these
    (templates/triton/hopper_window.py.j2)."""
    if not causal or launch.fused or launch.ranges is None:
        return None
    (ranges,) = launch.ranges
    if ranges.everything:
        return MAX_TOKENS
    window_only = ranges.prefix_blocks == 0 and ranges.local is None and ranges.progression is None
    if window_only and ranges.window is not None and ranges.window.right == 0:
        return ranges.window.left
    return None


def tabled_branches(plan: Plan, ranges_in_kernel: bool) -> tuple[str, ...]:
    """Names of the branches whose kernels read a host table: every static branch (its block
    table) and top-k branch (its forced blocks), except, where the kernels compute key ranges
    themselves (`ranges_in_kernel`), the static branches of range form."""
    ranged = {b.name for launch in static_launches(plan) if launch.ranges is not None for b in launch.branches}
    return tuple(
        b.name for b in plan.branches
        if isinstance(b, TopKBranch) or (isinstance(b, StaticBranch) and not (ranges_in_kernel and b.name in ranged))
    )
