"""The .nsa front end on valid input: every construct reaches the right model value."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import nsa_dsl
from nsa_dsl.dsl import ast, load, load_pattern, model, parse
from nsa_dsl.errors import NsaSemanticError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HEAD = "pattern p\nblock 64\n"


def keys(expression: str, head: str = HEAD) -> object:
    """The keys of the branch `b = <expression>`, declared last after `head`."""
    return load_pattern(f"{head}branch b = {expression}\n").branches[-1].keys


W, L, S, G = model.Window, model.Local, model.Stride, model.Global
U, Inter, D = model.Union, model.Intersection, model.Difference


# ---- examples ------------------------------------------------------------------------------
def test_every_example_is_checked():
    files = sorted(EXAMPLES.glob("*.nsa"))
    assert {f.stem for f in files} >= {
        "sliding_window", "strided", "longformer", "bigbird", "nsa", "nsa_meanpool", "documents",
    }  # fmt: skip
    for path in files:
        (pattern,) = load(path)
        assert pattern.name == path.stem
        assert pattern.block_size == 64


def test_examples_mean_what_their_comments_say():
    assert load_pattern(EXAMPLES / "sliding_window.nsa").branches[0].keys == W(512, 0)
    strided = load_pattern(EXAMPLES / "strided.nsa")
    assert strided.params == (("every", 8),)
    assert strided.branches[0].keys == U((L(2, 0), S(8, 7)))
    assert load_pattern(EXAMPLES / "longformer.nsa").branches[0].keys == U((W(512, 0), G(1)))
    bigbird = load_pattern(EXAMPLES / "bigbird.nsa")
    assert not bigbird.causal
    assert bigbird.branches[0].keys == U((L(2, 1), G(2), model.Random(3, 0)))
    assert load_pattern(EXAMPLES / "documents.nsa").branches[0].keys == U((L(4, 0), G(1)))

    nsa = load_pattern(EXAMPLES / "nsa.nsa")
    assert nsa.causal
    assert [(b.name, b.gate) for b in nsa.branches] == [
        ("cmp", model.Gate("g_cmp")),
        ("slc", model.Gate("g_slc")),
        ("swa", model.Gate("g_swa")),
    ]
    assert nsa.branches[0].keys == model.Compress(block=32, stride=16, pool="mean")
    assert nsa.branches[1].keys == model.TopK(count=16, block=64, score="cmp", force=U((G(1), L(2, 0))))
    assert nsa.branches[2].keys == W(512, 0)

    meanpool = load_pattern(str(EXAMPLES / "nsa_meanpool.nsa"))  # a str path works too
    assert meanpool.branches[0].keys == model.Compress(64, 64)
    assert meanpool.branches[1].keys == model.TopK(16, 64, "cmp", L(1, 0))


# ---- atoms -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("window(512)", W(512, 0)),
        ("window(3, 2)", W(3, 2)),
        ("window(left=0, right=4)", W(0, 4)),
        ("window(right=1, left=2)", W(2, 1)),
        ("local(2)", L(2, 0)),
        ("local(before=1, after=1)", L(1, 1)),
        ("stride(4)", S(4, 0)),
        ("stride(every=4, offset=3)", S(4, 3)),
        ("global(first=3)", G(3)),
        ("global(2)", G(2)),
        ("blocks(7, 2, 7, 0)", model.Blocks((0, 2, 7))),
        ("random(3)", model.Random(3, 0)),
        ("random(count=2, seed=9)", model.Random(2, 9)),
        ("window(4,)", W(4, 0)),
    ],
)
def test_atoms(expression, expected):
    assert keys(expression) == expected


def test_leading_zeros_change_no_number():
    # more digits than Python's int() converts (4300), all but the last zeros
    assert keys("window(" + "0" * 5000 + "1)") == W(1, 0)
    assert keys("window(007, right=00)") == W(7, 0)


def test_readme_example():
    pattern = load_pattern(
        """
        pattern longformer
        param window = 512                 # comments run to the end of the line
        block 64
        causal
        branch main = window(window) | global(first=1) | stride(every=8) gate g_slc
        """
    )
    assert pattern.branches[0].keys == U((W(512, 0), G(1), S(8, 0)))
    assert pattern.branches[0].gate == model.Gate("g_slc", None)
    assert pattern.params == (("window", 512),)


# ---- expressions ---------------------------------------------------------------------------
def test_precedence_and_associativity():
    a, b, c = "local(1)", "stride(2)", "global(first=1)"
    assert keys(f"{a} | {b} & {c}") == U((L(1, 0), Inter((S(2, 0), G(1)))))
    assert keys(f"({a} | {b}) & {c}") == Inter((U((L(1, 0), S(2, 0))), G(1)))
    assert keys(f"{a} - {b} | {c}") == U((D(L(1, 0), S(2, 0)), G(1)))
    assert keys(f"{a} - ({b} | {c})") == D(L(1, 0), U((S(2, 0), G(1))))
    assert keys(f"{a} & {b} - {c}") == Inter((L(1, 0), D(S(2, 0), G(1))))
    assert keys(f"{a} - {b} - {c}") == D(D(L(1, 0), S(2, 0)), G(1))
    # unions and intersections flatten, whatever the parentheses
    assert keys(f"{a} | ({b} | {c})") == U((L(1, 0), S(2, 0), G(1)))
    assert keys(f"{a} & {b} & {c}") == Inter((L(1, 0), S(2, 0), G(1)))


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("20 - 4 - 3", 13),
        ("17 // 5", 3),
        ("-3 + 10", 7),
        ("- -7", 7),
        ("2 * -3 + 100", 94),
        ("10 / 4 * 2", 5.0),
        ("1.5 + .5e1", 6.5),
        ("2e2", 200.0),
        ("x // 2", 50),
        ("true", True),
        ("flag", False),
    ],
)
def test_arithmetic(expression, value):
    pattern = load_pattern(
        f"pattern p\nparam x = 100\nparam flag = false\nparam r = {expression}\nblock 64\nbranch b = local(1)"
    )
    assert pattern.params[-1] == ("r", value)
    assert type(pattern.params[-1][1]) is type(value)


def test_expressions_span_lines_and_params_feed_atoms():
    pattern = load_pattern(
        """pattern p
        param w = 256
        param half = w // 2
        block 16 * 4
        branch b =
            window(half + 1,
                   right=w - 256)
          | stride(every = 3, offset = 2)
        """
    )
    assert pattern.block_size == 64
    assert pattern.params == (("w", 256), ("half", 128))
    assert pattern.branches[0].keys == U((W(129, 0), S(3, 2)))


def test_branch_references_are_inlined():
    pattern = load_pattern(
        HEAD
        + """
        branch near = local(2)
        branch both = near | far          # a reference may come before the branch it names
        branch far = stride(8) - near
        """
    )
    near, both, far = (b.keys for b in pattern.branches)
    assert near == L(2, 0)
    assert far == D(S(8, 0), L(2, 0))
    assert both == U((L(2, 0), D(S(8, 0), L(2, 0))))


def test_force_may_reference_a_block_level_branch():
    pattern = load_pattern(
        HEAD
        + """
        branch sinks = global(first=2)
        branch cmp = compress(block=64)
        branch slc = topk(8, score=cmp, force=sinks | local(3))
        """
    )
    assert pattern.branches[2].keys == model.TopK(8, 64, "cmp", U((G(2), L(3, 0))))


# ---- statements and options ----------------------------------------------------------------
def test_masking_defaults_to_causal():
    assert load_pattern(HEAD + "branch b = local(1)").causal
    assert load_pattern(HEAD + "causal branch b = local(1)").causal
    assert not load_pattern(HEAD + "bidirectional branch b = local(1)").causal


def test_gates():
    pattern = load_pattern(
        HEAD
        + """
        gate g_extra
        branch a = local(1)
        branch b = local(2) gate g_swa
        branch c = local(3) gate g_extra default 1
        branch d = local(4) gate g_slc default 0.25
        """
    )
    assert [b.gate for b in pattern.branches] == [
        None,
        model.Gate("g_swa", None),
        model.Gate("g_extra", 1.0),
        model.Gate("g_slc", 0.25),
    ]
    assert type(pattern.branches[2].gate.default) is float


def test_compress_and_topk_defaults():
    pattern = load_pattern(
        "pattern p\nblock 32\n"
        "branch cmp = compress(16)\n"
        "branch slc = topk(4, score=cmp)\n"
        "branch cmp2 = compress(block=32, stride=8, pool=mean)\n"
        "branch slc2 = topk(count=4, block=128, score=cmp2)\n"
        "branch slc3 = topk(4, 64, cmp, local(2))\n"  # positional: count, block, score, force
    )
    got = [b.keys for b in pattern.branches]
    assert got == [
        model.Compress(16, 16, "mean"),
        model.TopK(4, 32, "cmp", None),
        model.Compress(32, 8, "mean"),
        model.TopK(4, 128, "cmp2", None),
        model.TopK(4, 64, "cmp", L(2, 0)),
    ]


def test_selection_granularity():
    pattern = load_pattern(
        HEAD
        + """
        param q = 32
        branch cmp = compress(32, 16)
        branch a = topk(4, score=cmp)
        branch b = topk(4, score=cmp) per token
        branch c = topk(4, score=cmp) per block(64)
        branch d = topk(4, score=cmp) per block(q * 2) gate g_slc default 1 if on
        branch e = topk(4, score=cmp) if on per block(1) gate g_slc default 1
        param on = true
        """
    )
    assert [b.query_block for b in pattern.branches] == [1, 1, 1, 64, 64, 1]


def test_topk_force_count_may_equal_what_force_adds():
    # global(1) + local(2) = 3 forced blocks; topk(3) holds exactly them
    assert keys("topk(3, score=c, force=global(1) | local(2))", HEAD + "branch c = compress(64)\n").count == 3
    # blocks() ids already in global(first=2) are not counted twice: 2 + 1
    assert keys("topk(3, score=c, force=global(2) | blocks(0, 1, 5))", HEAD + "branch c = compress(64)\n").count == 3
    # blocks after the query's own are never selectable in a causal pattern
    assert keys("topk(2, score=c, force=local(2, 3))", HEAD + "branch c = compress(64)\n").count == 2


def test_if_drops_branches():
    text = HEAD + "param use_swa = true\nbranch a = local(1)\nbranch swa = window(512) gate g_swa if use_swa\n"
    assert [b.name for b in load_pattern(text).branches] == ["a", "swa"]
    dropped = load_pattern(text, overrides={"use_swa": False})
    assert [b.name for b in dropped.branches] == ["a"]
    assert dropped.params == (("use_swa", False),)


# ---- params and overrides ------------------------------------------------------------------
PARAMS = """pattern p
param window = 512
param half = window // 2
param ratio = 0.5
param sinks = true
block 64
branch b = window(half) | global(1) if sinks
branch c = local(1)
"""


@pytest.mark.parametrize(
    ("overrides", "params"),
    [
        ({}, (("window", 512), ("half", 256), ("ratio", 0.5), ("sinks", True))),
        ({"window": 1024}, (("window", 1024), ("half", 512), ("ratio", 0.5), ("sinks", True))),
        ({"window": "1024"}, (("window", 1024), ("half", 512), ("ratio", 0.5), ("sinks", True))),
        ({"half": 7, "ratio": 2}, (("window", 512), ("half", 7), ("ratio", 2.0), ("sinks", True))),
        ({"ratio": "0.25", "sinks": "false"}, (("window", 512), ("half", 256), ("ratio", 0.25), ("sinks", False))),
        ({"ratio": "3", "sinks": False}, (("window", 512), ("half", 256), ("ratio", 3.0), ("sinks", False))),
        # numpy scalars, as configs and array code give them, count as their Python values
        ({"window": np.int64(96), "ratio": np.float32(0.25), "sinks": np.bool_(False)},
         (("window", 96), ("half", 48), ("ratio", 0.25), ("sinks", False))),
        ({"half": np.uint8(7), "ratio": np.int32(2)}, (("window", 512), ("half", 7), ("ratio", 2.0), ("sinks", True))),
    ],
)
def test_overrides(overrides, params):
    pattern = load_pattern(PARAMS, overrides=overrides)
    assert pattern.params == params
    assert [type(v) for _, v in pattern.params] == [int, int, float, bool]
    assert [b.name for b in pattern.branches] == (["b", "c"] if params[3][1] else ["c"])
    if params[3][1]:
        assert pattern.branches[0].keys == U((W(params[1][1], 0), G(1)))


# ---- files holding several patterns ---------------------------------------------------------
TWO = """
pattern first
param window = 128
block 64
branch b = window(window)

pattern second
block 32
bidirectional
branch b = local(1, 1)
"""


def test_several_patterns():
    first, second = load(TWO)
    assert (first.name, first.block_size, first.causal) == ("first", 64, True)
    assert (second.name, second.block_size, second.causal) == ("second", 32, False)
    assert load_pattern(TWO, name="second") == second
    # an override applies to the patterns declaring it
    assert load(TWO, overrides={"window": 64})[0].branches[0].keys == W(64, 0)
    with pytest.raises(NsaSemanticError, match="holds 2 patterns") as info:
        load_pattern(TWO)
    assert info.value.hint.startswith("pick one of: first, second (nsa_dsl.compile(..., pattern=NAME)")
    with pytest.raises(NsaSemanticError, match="holds 2 patterns") as info:
        nsa_dsl.compile(TWO)
    assert "pattern=NAME" in info.value.hint


def test_load_from_path(tmp_path):
    path = tmp_path / "two.nsa"
    path.write_text(TWO)
    assert load(path) == load(str(path)) == load(TWO)
    with pytest.raises(NsaSemanticError) as info:
        load(path, overrides={"windw": 1})
    assert info.value.file == str(path)
    assert info.value.hint == "did you mean 'window'?"



def test_load_a_file_saved_with_a_byte_order_mark(tmp_path):
    """Editors on Windows may start a UTF-8 file with a byte order mark: it is not part of the text."""
    path = tmp_path / "bom.nsa"
    path.write_bytes(b"\xef\xbb\xbf" + TWO.encode())
    assert load(path) == load(TWO)
    # the same text read by the caller (open(path).read() keeps the mark): an invisible stray character it was
    assert load(path.read_text(encoding="utf-8")) == load(TWO)


@pytest.mark.parametrize("newline", ["\r\n", "\r"], ids=["CRLF", "CR"])
def test_text_with_other_line_endings_means_the_same(newline):
    """A comment ends at any line ending: with lone CRs (text read without universal newlines) it
    ran to the end of the text, silently dropping every statement after it."""
    text = "pattern p\nblock 64\n# a window\nbranch a = window(4)\n# and a sink\nbranch b = global(first=1)\n"
    assert load(text.replace("\n", newline)) == load(text)

# ---- the syntax tree -------------------------------------------------------------------------
def test_parse_builds_positioned_nodes():
    module = parse("pattern p\n  block 64\n  branch b = window(w - 1, right=2) gate g_swa default 1\n", file="f.nsa")
    assert module.file == "f.nsa"
    (pattern,) = module.patterns
    assert pattern.name == ast.Identifier("p", 1, 9)
    block, branch = pattern.statements
    assert block == ast.BlockSize(ast.IntLiteral(64, 2, 9), 2, 3)
    assert branch.name == ast.Identifier("b", 3, 10)
    call = branch.value
    assert (call.function, call.line, call.column) == ("window", 3, 14)
    assert call.arguments == (
        ast.Argument(None, ast.Binary("-", ast.Name("w", 3, 21), ast.IntLiteral(1, 3, 25), 3, 23), 3, 23),
        ast.Argument("right", ast.IntLiteral(2, 3, 34), 3, 28),
    )
    assert branch.options == (ast.GateClause(ast.Identifier("g_swa", 3, 42), ast.IntLiteral(1, 3, 56), 3, 37),)


def test_reference_examples_are_valid():
    """Every example in the README's DSL reference checks (fragments inside a minimal pattern);
    the README's shell and Python blocks are fenced with a language and left out."""
    reference = (EXAMPLES.parent / "README.md").read_text()
    blocks, language, lines = [], None, []
    for line in reference.splitlines():
        if not line.startswith("```"):
            lines.append(line)
        elif language is None:
            language, lines = line[3:].strip(), []
        else:
            if not language:
                blocks.append("\n".join(lines) + "\n")
            language = None
    examples = [b for b in blocks if "Error" not in b]
    assert len(examples) >= 7
    for text in examples:
        whole = re.search(r"^pattern ", text, flags=re.M)
        assert load(text if whole else HEAD + text)
