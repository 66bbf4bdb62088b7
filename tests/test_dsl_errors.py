"""Every error of the .nsa front end: its class, message, hint, and exact place."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import nsa_dsl
from nsa_dsl.dsl import load, load_pattern, parse
from nsa_dsl.errors import NsaError, NsaSemanticError, NsaSyntaxError

HEAD = "pattern p\nblock 64\n"  # statements under test start on line 3
CMP = HEAD + "branch cmp = compress(32, 16)\n"  # ... on line 4 (line 3 is the compress branch)


def failure(text: str, **kwargs) -> NsaError:
    with pytest.raises(NsaError) as info:
        load(text, **kwargs)
    return info.value


SYNTAX = [
    # (source, message, line, column, hint)
    ("", "unexpected end of input", 1, 1, "expected 'pattern'"),
    ("# only a comment\n\n", "unexpected end of input", 1, 1, "expected 'pattern'"),
    ("block 64\n", "unexpected 'block'", 1, 1, "expected 'pattern'"),
    (HEAD + "branch b = window(4", "unexpected end of input", 3, 20, "expected one of: ')', ','"),
    (HEAD + "branch b = 1 +   # more to come\n", "unexpected end of input", 3, 15, None),
    # lone CR line endings (text read with newline=""): positioned by their lines all the same
    ("pattern p\rblock 64\r# a window\rbranch b = window(4", "unexpected end of input", 4, 20, "expected one of: ')', ','"),
    ("pattern p\r\nblock 64\r\nbranch b = window(4", "unexpected end of input", 3, 20, "expected one of: ')', ','"),
    (HEAD + "branch b = window(4))", "unexpected ')'", 3, 21, None),
    (HEAD + "branch b = local(1) $", "unexpected character '$'", 3, 21, None),
    (HEAD + "branch b local(1)", "unexpected name 'local'", 3, 10, "expected '='"),
    (HEAD + "branch b = local(1) per 4", "unexpected integer '4'", 3, 25, "expected one of: 'block', 'token'"),
    (
        HEAD + "branch b = local(1) gate g_slc default x",
        "unexpected name 'x'",
        3,
        40,
        "expected one of: a decimal number, an integer",
    ),
    (HEAD + "branch b = window(block)", "unexpected ')'", 3, 24, "expected '='"),
    (HEAD + "branch b = local(1) gate g_slc default -1", "unexpected '-'", 3, 40, None),
    ("pattern p\nparam x = 99999999999999999999", "integer literal too large", 2, 11, "integers must be below 2**63"),
    (  # leading zeros are not counted, the digits after them are
        "pattern p\nparam x = " + "0" * 5000 + "9223372036854775808",
        "integer literal too large",
        2,
        11,
        "integers must be below 2**63",
    ),
    # digits are ASCII: other Unicode digits are stray characters, not part of a number
    (HEAD + "branch b = window(4\u0661)", "unexpected character '\u0661'", 3, 20, None),
    (HEAD + "branch b = window(\uff18)", "unexpected character '\uff18'", 3, 19, None),
    (HEAD + "param x = 0.\u0665", "unexpected character '\u0665'", 3, 13, None),
    ("pattern p\nblock 1\u0966", "unexpected character '\u0966'", 2, 8, None),
    # a keyword where a name is missing: read as the name, it moved the error to the next name
    # ("unexpected name 'n'" at 4:8, with 'branch' among the expected words)
    (
        HEAD + "branch m = window(4) gate\nbranch n = window(2)",
        "expected a name after 'gate', found the keyword 'branch'",
        4,
        1,
        "'branch' is a keyword of the language, never a name: is the name missing?",
    ),
    (
        "pattern p\nparam\nblock 64",
        "expected a name after 'param', found the keyword 'block'",
        3,
        1,
        "'block' is a keyword of the language, never a name: is the name missing?",
    ),
]


@pytest.mark.parametrize(("text", "message", "line", "column", "hint"), SYNTAX)
def test_syntax_errors(text, message, line, column, hint):
    err = failure(text)
    assert type(err) is NsaSyntaxError
    assert (err.message, err.line, err.column) == (message, line, column)
    assert err.source_line == text.replace("\r\n", "\n").replace("\r", "\n").split("\n")[line - 1]
    if hint is not None:
        assert err.hint == hint
    else:
        assert err.hint.startswith("expected ")


def test_syntax_error_text_has_caret():
    err = failure("pattern p\nblock 64\nbranch b = window(4, ) )\n", file="w.nsa")
    assert str(err) == (
        "w.nsa:3:24: NsaSyntaxError: unexpected ')'\n"
        "    branch b = window(4, ) )\n"
        "                           ^\n"
        "  hint: expected one of: end of input, 'bidirectional', 'block', 'branch', 'causal', 'gate', 'if', "
        "'param', 'pattern', 'per'"
    )
    with pytest.raises(NsaSyntaxError):
        parse("pattern")


SEMANTIC = [
    # (source, message, line, column, hint or None)
    # -- unknown names, with hints
    (HEAD + "branch b = windw(4)", "unknown function 'windw'", 3, 12, "did you mean 'window'?"),
    (
        HEAD + "param w = 4\nbranch b = w(4)",
        "unknown function 'w'",
        4,
        12,
        "'w' is a name, not a function: write it without parentheses",
    ),
    (HEAD + "param window = 4\nbranch b = local(windw)", "unknown name 'windw'", 4, 18, "did you mean 'window'?"),
    (
        HEAD + "branch near = local(1)\nbranch b = neer | global(1)",
        "unknown name 'neer'",
        4,
        12,
        "did you mean 'near'?",
    ),
    (HEAD + "branch b = stride", "unknown name 'stride'", 3, 12, "'stride' is a function: call it, e.g. stride(...)"),
    (HEAD + "branch b = window(4, rigth=1)", "window() has no argument 'rigth'", 3, 22, "did you mean 'right'?"),
    (HEAD + "branch b = local(1) gate g_slx", "unknown gate 'g_slx'", 3, 26, "did you mean 'g_slc'?"),
    (
        HEAD + "branch b = local(1) gate mine",
        "unknown gate 'mine'",
        3,
        26,
        "declare it with `gate mine` before the branches (built-in gates: g_cmp, g_slc, g_swa)",
    ),
    (HEAD + "gate g_mine\nbranch b = local(1) gate g_mien", "unknown gate 'g_mien'", 4, 26, "did you mean 'g_mine'?"),
    (CMP + "branch b = topk(4, score=cmq)", "unknown branch 'cmq'", 4, 26, "did you mean 'cmp'?"),
    (HEAD + "param on = true\nbranch b = local(1) if no", "unknown param 'no'", 4, 24, "bool params: on"),
    (HEAD + "param swa = true\nbranch b = local(1) if sw", "unknown param 'sw'", 4, 24, "did you mean 'swa'?"),
    # -- duplicates
    (
        HEAD + "branch b = local(1)\npattern p\nblock 64\nbranch b = local(1)",
        "duplicate pattern 'p' (first declared on line 1)",
        4,
        9,
        None,
    ),
    (
        HEAD + "param x = 1\nparam x = 2\nbranch b = local(x)",
        "duplicate name 'x': already a param (line 3)",
        4,
        7,
        None,
    ),
    (HEAD + "branch b = local(1)\nbranch b = local(2)", "duplicate name 'b': already a branch (line 3)", 4, 8, None),
    (HEAD + "param b = 1\nbranch b = local(2)", "duplicate name 'b': already a param (line 3)", 4, 8, None),
    (HEAD + "block 32\nbranch b = local(1)", "duplicate `block` statement (first on line 2)", 3, 1, None),
    (
        HEAD + "causal\nbidirectional\nbranch b = local(1)",
        "duplicate `causal/bidirectional` statement (first on line 3)",
        4,
        1,
        None,
    ),
    (HEAD + "gate g_x\ngate g_x\nbranch b = local(1)", "duplicate gate 'g_x' (first declared on line 3)", 4, 6, None),
    (
        HEAD + "branch b = local(1) gate g_slc\ngate g_x",
        "branch 'b' has a second `gate` clause (the first is on line 3)",
        4,
        1,
        "a `gate NAME` right after a branch's expression is that branch's gate clause; declare extra gates before the branches",
    ),
    (
        HEAD + "branch b = local(1) per token per token",
        "branch 'b' has a second `per` clause (the first is on line 3)",
        3,
        31,
        None,
    ),
    (CMP + "branch b = topk(4, score=cmp, count=5)", "topk() got two values for 'count'", 4, 31, None),
    # -- block size
    ("pattern p\nbranch b = local(1)", "pattern 'p' has no block size", 1, 9, "add e.g. `block 64`"),
    ("pattern p\nblock 48\nbranch b = local(1)", "block size must be a power of two >= 16, got 48", 2, 7, None),
    ("pattern p\nblock 8\nbranch b = local(1)", "block size must be a power of two >= 16, got 8", 2, 7, None),
    (
        "pattern p\nblock 1073741824\nbranch b = local(1)",
        "block size must be at most 2**29, the longest sequence nsa_dsl runs, got 1073741824",
        2,
        7,
        None,
    ),
    (
        "pattern p\nblock 64.0\nbranch b = local(1)",
        "block size must be an integer, got a float (64.0)",
        2,
        7,
        "write integers: a decimal point, an exponent (1e2) or a float operand (7.5 // 2) makes a float",
    ),
    ("pattern p\nparam b = 1\nblock b - 1\nbranch c = local(1)", "block size must be >= 1, got 0", 3, 9, None),
    # -- sizes
    (HEAD + "branch b = window(0)", "window(0, 0) is empty: left + right must be >= 1", 3, 12, None),
    (HEAD + "branch b = local(-1)", "local() argument 'before' must be >= 0, got -1", 3, 18, None),
    (HEAD + "branch b = local(0, after=0)", "local(0, 0) is empty: before + after must be >= 1", 3, 12, None),
    (HEAD + "branch b = stride(0)", "stride() argument 'every' must be >= 1, got 0", 3, 19, None),
    (HEAD + "branch b = stride(4, offset=4)", "stride() offset must be below every (4), got 4", 3, 29, None),
    (HEAD + "branch b = global(first=0)", "global() argument 'first' must be >= 1, got 0", 3, 25, None),
    (HEAD + "branch b = random(0)", "random() argument 'count' must be >= 1, got 0", 3, 19, None),
    (HEAD + "branch b = random(1, seed=-2)", "random() argument 'seed' must be >= 0, got -2", 3, 27, None),
    (HEAD + "branch b = blocks()", "blocks() needs at least one block id", 3, 12, None),
    (HEAD + "branch b = blocks(1, -1)", "blocks() id must be >= 0, got -1", 3, 22, None),
    (HEAD + "branch b = blocks(1, at=2)", "blocks() takes block ids as positional arguments only", 3, 22, None),
    (
        HEAD + "branch b = window(2147483647 + 1)",
        "window() argument 'left' must be at most 2**31 - 1, got 2147483648",
        3,
        30,
        None,
    ),
    (HEAD + "branch b = compress(0)", "compress() argument 'block' must be >= 1, got 0", 3, 21, None),
    (
        HEAD + "branch b = compress(536870913)",
        "compress() argument 'block' must be at most 2**29, the longest sequence nsa_dsl runs, got 536870913",
        3,
        21,
        None,
    ),
    (
        HEAD + "branch b = compress(16, stride=32)",
        "compress() stride (32) must be <= block (16): windows would leave gaps",
        3,
        32,
        None,
    ),
    (
        HEAD + "branch b = compress(16, pool=maen)",
        "compress() pool must be one of: mean, learned",
        3,
        30,
        "did you mean 'mean'?",
    ),
    # -- types
    (
        HEAD + "branch b = window(1.5)",
        "window() argument 'left' must be an integer, got a float (1.5)",
        3,
        19,
        "write integers: a decimal point, an exponent (1e2) or a float operand (7.5 // 2) makes a float",
    ),
    (
        HEAD + "param w = 512\nbranch b = window(w / 2)",
        "window() argument 'left' must be an integer, got a float (256.0)",
        4,
        21,
        "use // for integer division",
    ),
    (HEAD + "branch b = window(true)", "window() argument 'left' must be an integer, got a bool (true)", 3, 19, None),
    (
        HEAD + "branch b = window(local(1))",
        "window() argument 'left' must be an integer, got a key set (a key set)",
        3,
        19,
        None,
    ),
    (HEAD + "branch b = 4", "branch 'b' must be a key set, got an integer (4)", 3, 12, None),
    (
        HEAD + "param x = local(1)\nbranch b = local(1)",
        "param 'x' must be a number or bool, not a key set",
        3,
        11,
        None,
    ),
    (
        HEAD + "branch b = local(1) - 1",
        "'-' (set difference) needs key sets, but its right side is an integer",
        3,
        21,
        "'-' is set difference between key sets and subtraction between numbers",
    ),
    (
        HEAD + "branch b = 1 | local(1)",
        "'|' (union) needs key sets, but its left side is an integer",
        3,
        14,
        "use + - * / // for numbers",
    ),
    (
        HEAD + "branch b = local(1) & true",
        "'&' (intersection) needs key sets, but its right side is a bool",
        3,
        21,
        "use + - * / // for numbers",
    ),
    (
        HEAD + "branch b = local(1) + local(2)",
        "'+' needs numbers, but its left side is a key set",
        3,
        21,
        "combine key sets with | (union), & (intersection) and - (difference)",
    ),
    (
        HEAD + "param t = true\nparam x = t * 2\nbranch b = local(1)",
        "'*' needs numbers, but its left side is a bool",
        4,
        13,
        None,
    ),
    (HEAD + "branch b = -local(1)", "unary '-' needs a number, got a key set", 3, 12, None),
    (HEAD + "branch b = window(4 // 0)", "division by zero", 3, 21, None),
    (HEAD + "param x = 1 / (2 - 2)\nbranch b = local(1)", "division by zero", 3, 13, None),
    (HEAD + "param x = 1e999\nbranch b = local(1)", "number too large", 3, 11, None),
    (HEAD + "param x = 1e300 * 1e300\nbranch b = local(1)", "number too large", 3, 17, None),
    (HEAD + "param x = 4000000000 * 4000000000 * 4000000000\nbranch b = local(1)", "number too large", 3, 22, None),
    # -- params
    (
        HEAD + "param a = b + 1\nparam b = 2\nbranch c = local(a)",
        "param 'b' (line 4) has no value yet here; a param may only use earlier params",
        3,
        11,
        None,
    ),
    (
        HEAD + "param a = a\nbranch c = local(1)",
        "param 'a' (line 3) has no value yet here; a param may only use earlier params",
        3,
        11,
        None,
    ),
    (HEAD + "branch c = local(1)\nparam a = c", "'c' is a branch; only params can be used here", 4, 11, None),
    (HEAD + "param w = 4\nbranch b = local(1) if w", "`if` needs a bool param; 'w' is an integer (4)", 4, 24, None),
    # -- names
    (
        "pattern class\nblock 64\nbranch b = local(1)",
        "'class' is a Python keyword and cannot name a pattern",
        1,
        9,
        "names become identifiers in generated Python code",
    ),
    (
        HEAD + "branch lambda = local(1)",
        "'lambda' is a Python keyword and cannot name a branch",
        3,
        8,
        "names become identifiers in generated Python code",
    ),
    (HEAD + "param block = 1\nbranch b = local(1)", "'block' is a reserved word and cannot name a param", 3, 7, None),
    (HEAD + "gate token\nbranch b = local(1)", "'token' is a reserved word and cannot name a gate", 3, 6, None),
    (
        HEAD + "branch b = local(1) gate None",
        "'None' is a Python keyword and cannot name a gate",
        3,
        26,
        "names become identifiers in generated Python code",
    ),
    (
        HEAD + "param __debug__ = 1\nbranch b = local(1)",  # Python refuses it as a keyword argument
        "'__debug__' is a Python keyword and cannot name a param",
        3,
        7,
        "names become identifiers in generated Python code",
    ),
    # -- branches
    ("pattern p\nblock 64\nparam x = 1", "pattern 'p' has no branches", 1, 9, "add e.g. `branch main = window(256)`"),
    (
        HEAD + "param on = false\nbranch b = local(1) if on",
        "pattern 'p' keeps no branch: every branch's `if` param is false",
        1,
        9,
        None,
    ),
    (
        HEAD + "branch a = b | local(1)\nbranch b = c\nbranch c = a",
        "cycle between branches: a -> b -> c -> a",
        5,
        12,
        None,
    ),
    (HEAD + "branch a = a | local(1)", "cycle between branches: a -> a", 3, 12, None),
    (HEAD + "branch a = local(1) | b\nbranch b = a - stride(2)", "cycle between branches: a -> b -> a", 4, 12, None),
    (
        CMP + "branch b = cmp | local(1)",
        "branch 'cmp' is a compress() branch; only static key-set branches can be used in expressions",
        4,
        12,
        None,
    ),
    (
        CMP + "branch s = topk(4, score=cmp)\nbranch b = local(1) - s",
        "branch 's' is a topk() branch; only static key-set branches can be used in expressions",
        5,
        23,
        None,
    ),
    (
        HEAD + "branch b = local(1) | compress(64)",
        "compress() must be a branch's whole expression, not part of one",
        3,
        23,
        None,
    ),
    (
        CMP + "branch b = topk(4, score=cmp) | local(1)",
        "topk() must be a branch's whole expression, not part of one",
        4,
        12,
        None,
    ),
    (
        HEAD + "branch b = local(1) per block(4)",
        "`per block(...)` sets a topk branch's selection granularity; 'b' is a static branch",
        3,
        21,
        None,
    ),
    (
        CMP + "branch b = compress(32, 16) gate g per token",
        "`per token` sets a topk branch's selection granularity; 'b' is a compress branch",
        4,
        36,
        None,
    ),
    (
        CMP + "branch b = topk(4, score=cmp) per block(3)",
        "per block size must be a power of two >= 1, got 3",
        4,
        41,
        None,
    ),
    (
        CMP + "branch b = topk(4, score=cmp) per block(128)",
        "per block(128) must not exceed the pattern's block size (64)",
        4,
        41,
        None,
    ),
    (
        HEAD + "branch a = local(1) gate g_slc\nbranch b = local(2) gate g_slc default 1",
        "gate 'g_slc' has default 1.0 here but none on branch 'a'",
        4,
        21,
        "a gate's default must be the same on every branch that uses it",
    ),
    (HEAD + "branch b = local(1) gate g_slc default 1e999", "number too large", 3, 40, None),
    (
        HEAD + "branch b = local(1) gate g_slc default 1e39",  # was taken: every output inf
        "gate default 1e+39 is out of range: a gate is a float32 weight, at most 3.4e38 in magnitude",
        3,
        40,
        None,
    ),
    # -- topk
    (CMP + "branch b = topk(4)", "topk() needs argument 'score'", 4, 12, None),
    (CMP + "branch b = topk(4, score=cmp, 64)", "topk(): positional argument after a keyword argument", 4, 31, None),
    (
        CMP + "branch b = topk(4, 64, cmp, local(1), 5)",
        "topk() takes at most 4 arguments (count, block, score, force)",
        4,
        39,
        None,
    ),
    (CMP + "branch b = topk(0, score=cmp)", "topk() argument 'count' must be >= 1, got 0", 4, 17, None),
    (
        CMP + "branch b = topk(4, score=cmp(1))",
        "topk() score= must name a compress branch",
        4,
        26,
        "compress branches: cmp",
    ),
    (
        CMP + "branch w = window(4)\nbranch b = topk(4, score=w)",
        "topk() score= must name a compress branch; 'w' is a static branch",
        5,
        26,
        "compress branches: cmp",
    ),
    (
        HEAD + "branch w = window(4)\nbranch b = topk(4, score=w)",
        "topk() score= must name a compress branch; 'w' is a static branch",
        4,
        26,
        "this pattern has no compress branches",
    ),
    (
        CMP + "branch b = topk(4, block=48, score=cmp)",
        "topk() argument 'block' must be a power of two >= 16, got 48",
        4,
        26,
        None,
    ),
    (
        CMP + "branch b = topk(4, block=8, score=cmp)",
        "topk() argument 'block' must be a power of two >= 16, got 8",
        4,
        26,
        None,
    ),
    (
        CMP + "branch b = topk(4, block=1073741824, score=cmp)",
        "topk() argument 'block' must be at most 2**29, the longest sequence nsa_dsl runs, got 1073741824",
        4,
        26,
        None,
    ),
    (
        HEAD + "branch c = compress(48, 24)\nbranch b = topk(4, score=c)",
        "topk() block (64) must be a multiple of the stride (24) of compress branch 'c'",
        4,
        12,
        None,
    ),
    (
        HEAD + "branch c = compress(48, 24)\nbranch b = topk(4, block=128, score=c)",
        "topk() block (128) must be a multiple of the stride (24) of compress branch 'c'",
        4,
        26,
        None,
    ),
    (
        CMP + "branch b = topk(2, score=cmp, force=global(first=1) | local(2))",
        "topk(2) cannot hold the 3 blocks force= always adds",
        4,
        17,
        "count includes the forced blocks: use at least topk(3, ...)",
    ),
    (
        CMP + "branch b = topk(3, score=cmp, force=local(2, 1) | blocks(0, 9) | local(1, 2) | stride(2))",
        "topk(3) cannot hold the 4 blocks force= always adds",
        4,
        17,
        "count includes the forced blocks: use at least topk(4, ...)",
    ),
    (  # was taken, and at run time the forced blocks cut to 2 by id: a query's own block dropped
        CMP + "branch b = topk(2, score=cmp, force=local(1) | stride(2))",
        "force= adds more blocks the longer the sequence (a stride), more than topk(2) holds",
        4,
        46,
        "bound it, e.g. `stride(2) & local(16)`, and count the bound in topk's count",
    ),
    (
        CMP + "branch b = topk(4, score=cmp, force=global(first=1) | (stride(2) & local(8)) | random(2))",
        "topk(4) cannot hold the up to 11 blocks force= adds",
        4,
        17,
        "count includes the forced blocks: use at least topk(11, ...)",
    ),
    (  # a sequence of the longest the kernels run (2**29 tokens) has 2**23 blocks of 64
        CMP + "branch b = topk(3, score=cmp, force=global(2147483647) | local(2147483647))",
        "topk(3) cannot hold the 8388608 blocks force= always adds",
        4,
        17,
        "count includes the forced blocks: use at least topk(8388608, ...)",
    ),
    (
        HEAD + "bidirectional\nbranch cmp = compress(32, 16)",
        "compress() needs a causal pattern: compressed blocks and top-k selection are defined "
        "over the keys that precede a query",
        4,
        14,
        "declare `causal` (the default) or drop the compress/topk branches",
    ),
    (
        CMP + "branch b = topk(4, score=cmp, force=local(1) | window(4))",
        "window() is token-level; force= takes block-level key sets only",
        4,
        48,
        "use local(...) for whole neighbouring blocks",
    ),
    (
        CMP + "branch w = window(4) | local(1)\nbranch b = topk(4, score=cmp, force=w - stride(2))",
        "branch 'w' uses window(), which is token-level; force= takes block-level key sets only",
        5,
        37,
        "use local(...) for whole neighbouring blocks",
    ),
    (
        CMP + "branch b = topk(4, score=cmp, force=3)",
        "topk() force= must be a key set, got an integer (3)",
        4,
        37,
        None,
    ),
    (
        HEAD + "param on = false\nbranch cmp = compress(64) if on\nbranch b = topk(4, score=cmp)",
        "topk branch 'b' is scored by 'cmp', which `if on` drops",
        5,
        12,
        "add `if on` to 'b' too, or keep 'cmp'",
    ),
]


@pytest.mark.parametrize(("text", "message", "line", "column", "hint"), SEMANTIC)
def test_semantic_errors(text, message, line, column, hint):
    err = failure(text)
    assert type(err) is NsaSemanticError
    assert (err.message, err.line, err.column) == (message, line, column)
    assert err.source_line == text.split("\n")[line - 1]
    assert err.hint == hint
    assert err.file == "<string>"


def test_semantic_error_text_has_caret():
    err = failure("pattern p\nblock 64\nbranch b = window(4) | globl(first=1)\n", file="x.nsa")
    assert str(err) == (
        "x.nsa:3:24: NsaSemanticError: unknown function 'globl'\n"
        "    branch b = window(4) | globl(first=1)\n"
        "                           ^\n"
        "  hint: did you mean 'global'?"
    )


@pytest.mark.parametrize("text", ["pattern p\nblock 64\nbranch b = window(4) | globl(first=1)\n", "pattern p\nblock 64\n$"])
def test_an_error_pickles_to_the_same_error(text):
    """Process pools and multiprocessing send errors back pickled: the copy was rebuilt from the
    formatted text, so it read '<string>: NsaSemanticError: x.nsa:3:24: NsaSemanticError: ...'."""
    err = failure(text, file="x.nsa")
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err) and str(copy) == str(err)
    assert (copy.message, copy.file, copy.line, copy.column, copy.hint) == (err.message, err.file, err.line, err.column, err.hint)


def test_caret_lines_up_under_tabs():
    """The caret's indent copies the echoed line's tabs, so it sits under the column at any tab width."""
    err = failure("pattern p\n\tblock\t64\n\tbranch b =\twindow(4)\t|\tglobl(1)\n", file="t.nsa")
    assert (err.line, err.column) == (3, 25)
    assert str(err).splitlines()[:3] == [
        "t.nsa:3:25: NsaSemanticError: unknown function 'globl'",
        "    \tbranch b =\twindow(4)\t|\tglobl(1)",
        "    \t          \t         \t \t^",
    ]


def test_block_atom_limit_is_a_located_error():
    """Lowering numbers a key set's distinct block atoms in the bits of an int32; the checker
    refuses the 32nd, at the branch's expression, before anything is lowered."""
    atoms = [f"stride({every})" for every in range(2, 34)]
    union = " | ".join(atoms)
    err = failure(HEAD + "branch ok = window(4)\nbranch many = " + union + "\n", file="atoms.nsa")
    assert type(err) is NsaSemanticError
    assert err.message == "branch 'many' uses 32 distinct block atoms; at most 31"
    assert (err.file, err.line, err.column) == ("atoms.nsa", 4, 408)  # the expression's last '|'
    assert err.hint == (
        "block atoms are the local, stride, global, blocks and random calls, counted after inlining "
        "branch references; equal ones count once"
    )
    assert str(err).startswith("atoms.nsa:4:408: NsaSemanticError: ")
    assert str(err).splitlines()[2].endswith("^")
    # 31 are fine, and equal atoms (after inlining too) count once
    assert len(load_pattern(HEAD + "branch b = " + " | ".join(atoms[:31])).branches[0].keys.parts) == 31
    twice = HEAD + "branch a = " + " | ".join(atoms[:31]) + "\nbranch b = a - (" + " | ".join(atoms[:31]) + ")"
    assert len(load_pattern(twice).branches) == 2
    # a branch referenced into another counts there with that branch's own atoms
    halves = HEAD + "branch a = " + " | ".join(atoms[:16]) + "\nbranch b = a | " + " | ".join(atoms[16:])
    err = failure(halves)
    assert (err.message, err.line, err.column) == ("branch 'b' uses 32 distinct block atoms; at most 31", 4, 209)
    forced = CMP + "branch b = topk(40, score=cmp, force=" + union + ")"
    err = failure(forced)
    assert (err.message, err.line, err.column) == ("topk() force= uses 32 distinct block atoms; at most 31", 4, 431)


def test_deep_nesting_is_an_error_not_a_crash():
    deep = HEAD + "branch b = " + "window(" * 300 + "1" + ")" * 300
    err = failure(deep)
    assert type(err) is NsaSemanticError and err.message == "expression nested too deeply"
    parens = HEAD + "param x = " + "-(" * 300 + "1" + ")" * 300 + "\nbranch b = local(1)"
    assert failure(parens).message == "expression nested too deeply"
    # long left-associative chains are not nesting (windows: no block atoms, which are at most 31)
    chain = HEAD + "branch b = " + " | ".join(f"window({i})" for i in range(1, 2001))
    assert len(load_pattern(chain).branches[0].keys.parts) == 2000


def test_exponential_inlining_is_bounded():
    text = HEAD + "branch b0 = local(1)\n" + "".join(f"branch b{i} = b{i - 1} - b{i - 1}\n" for i in range(1, 40))
    err = failure(text)
    assert err.message.startswith("branch 'b13' is too large after inlining branch references")


# ---- overrides and loading -----------------------------------------------------------------
OVERRIDABLE = HEAD + "param window = 512\nparam ratio = 0.5\nparam on = true\nbranch b = window(window) if on\n"


@pytest.mark.parametrize(
    ("overrides", "message", "hint"),
    [
        ({"windw": 1}, "override 'windw' names no param of pattern 'p'", "did you mean 'window'?"),
        ({"zzz": 1}, "override 'zzz' names no param of pattern 'p'", "params: on, ratio, window"),
    ],
)
def test_unknown_override(overrides, message, hint):
    with pytest.raises(NsaSemanticError) as info:
        load_pattern(OVERRIDABLE, overrides=overrides)
    assert (info.value.message, info.value.hint, info.value.line) == (message, hint, None)
    with pytest.raises(NsaSemanticError, match="names no param of any pattern"):
        load(OVERRIDABLE, overrides=overrides)


@pytest.mark.parametrize(
    ("name", "value", "kind", "example"),
    [
        ("window", "1024.5", "an integer", "512"),
        ("window", 1024.0, "an integer", "512"),
        ("window", True, "an integer", "512"),
        ("window", np.float64(1024.0), "an integer", "512"),
        ("window", np.bool_(True), "an integer", "512"),
        ("window", "big", "an integer", "512"),
        ("window", "\u0661\u0660\u0662\u0664", "an integer", "512"),  # Arabic-Indic digits are no number
        ("ratio", "x", "a float", "0.5"),
        ("ratio", "\uff10.5", "a float", "0.5"),
        ("ratio", False, "a float", "0.5"),
        ("on", 1, "a bool", "true"),
        ("on", np.int64(1), "a bool", "true"),
        ("on", "yes", "a bool", "true"),
        ("on", None, "a bool", "true"),
    ],
)
def test_override_of_the_wrong_type(name, value, kind, example):
    with pytest.raises(NsaSemanticError) as info:
        load_pattern(OVERRIDABLE, overrides={name: value})
    err = info.value
    assert err.message == f"override {name}={value!r} does not fit: param '{name}' is {kind}"
    assert err.hint == f"give {kind}, e.g. -D {name}={example}"
    declaration = {"window": (3, 7), "ratio": (4, 7), "on": (5, 7)}[name]
    assert (err.line, err.column) == declaration


@pytest.mark.parametrize(
    ("name", "value", "limit"),
    [
        ("window", "9" * 30, "2**63 - 1"),
        ("window", 2**70, "2**63 - 1"),
        ("window", -(2**63), "2**63 - 1"),
        ("ratio", float("inf"), "1e308"),
        ("ratio", "1e400", "1e308"),
        ("ratio", 10**400, "1e308"),  # an int for a float param: math.isfinite overflowed on it
        ("ratio", "1" + "0" * 400, "1e308"),
        ("ratio", float("nan"), "1e308"),
    ],
)
def test_override_out_of_range_is_told_so(name, value, limit):
    """A number of the right kind but too large: saying "give an integer" of an integer misled."""
    err = failure(OVERRIDABLE, overrides={name: value})
    assert err.message == f"override {name}={value!r} is out of range: at most {limit} in magnitude"
    assert err.hint is None


def test_a_float_made_without_division_is_not_told_to_use_floor_division():
    err = failure(HEAD + "param a = 7.5 // 2\nbranch b = window(a)")
    assert (err.line, err.column) == (4, 19)
    assert "7.5 // 2" in err.hint and "use //" not in err.hint


def test_a_file_that_is_not_utf8_is_located(tmp_path):
    path = tmp_path / "latin1.nsa"
    path.write_bytes(b"\xef\xbb\xbfpattern p\nblock 16\n# caf\xe9 au lait\nbranch m = window(3)\n")
    with pytest.raises(NsaError) as info:
        load(path)
    err = info.value
    assert err.message == "not UTF-8 text: byte 0xe9 (invalid continuation byte)"
    assert (err.file, err.line, err.column) == (str(path), 3, 6)
    assert err.source_line == "# caf\ufffd au lait"


@pytest.mark.parametrize("line_end", [b"\r\n", b"\r"])
def test_a_file_that_is_not_utf8_is_located_whatever_its_line_ends(tmp_path, line_end):
    """Lines ended by CR alone (as parse() reads them) were one line here: line 1, the whole file."""
    path = tmp_path / "latin1.nsa"
    path.write_bytes(line_end.join([b"pattern p", b"block 16", b"branch m = window(3) # caf\xe9", b""]))
    with pytest.raises(NsaError, match="not UTF-8 text") as info:
        load(path)
    assert (info.value.line, info.value.column, info.value.source_line) == (3, 27, "branch m = window(3) # caf\ufffd")


def test_override_can_make_a_pattern_invalid():
    err = failure(OVERRIDABLE, overrides={"window": 0})
    assert (err.message, err.line, err.column) == ("window(0, 0) is empty: left + right must be >= 1", 6, 12)


def test_load_pattern_by_unknown_name():
    text = HEAD + "branch b = local(1)\npattern other\nblock 64\nbranch b = local(1)"
    with pytest.raises(NsaSemanticError) as info:
        load_pattern(text, name="othr")
    assert (info.value.message, info.value.hint) == ("no pattern named 'othr'", "did you mean 'other'?")
    with pytest.raises(NsaSemanticError) as info:
        load_pattern(text, name="zzz")
    assert info.value.hint == "patterns here: p, other"


def test_unreadable_file(tmp_path):
    with pytest.raises(NsaError, match="cannot read") as info:
        load(tmp_path / "missing.nsa")
    assert info.value.file == str(tmp_path / "missing.nsa")
    bad = tmp_path / "bad.nsa"
    bad.write_bytes(b"pattern \xff\n")
    with pytest.raises(NsaError, match="not UTF-8 text") as info:
        load(bad)
    assert (info.value.line, info.value.column) == (1, 9)
    with pytest.raises(NsaSyntaxError) as info:
        bad.write_text("pattern p\nblock 64\nbranch b = local(1))\n")
        load(bad)
    assert (info.value.file, info.value.line, info.value.column) == (str(bad), 3, 20)


def test_compile_refuses_a_pattern_name_that_is_no_str():
    text = HEAD + "branch b = local(1)\npattern other\nblock 64\nbranch b = local(1)"
    for name in (1, 2.5, b"p"):
        with pytest.raises(ValueError, match=f"^pattern must be a str or None, got {type(name).__name__}$"):
            nsa_dsl.compile(text, pattern=name)


def test_a_str_naming_a_file_that_is_not_nsa_says_how_to_read_it(tmp_path):
    """A str is a path only when it ends in .nsa: other names were parsed as text, "unexpected '/'"
    with nothing to say why."""
    path = tmp_path / "pattern.txt"
    path.write_text("pattern p\nblock 16\nbranch m = window(3)\n")
    err = failure(str(path))
    assert (err.line, err.column) == (1, 1)
    assert err.hint == (f"{str(path)!r} names a file, read as .nsa text: pass pathlib.Path({str(path)!r}) to read the "
                        "file (a str is a path only when it is one line ending in .nsa)")
    assert load(path) == load(path.read_text())
    # a .nsa path with a line end after it is text too; a path to no file says so
    nsa_path = tmp_path / "pattern.nsa"
    nsa_path.write_text(path.read_text())
    assert failure(f"{nsa_path}\n").hint.startswith(f"{str(nsa_path)!r} names a file, read as .nsa text: pass")
    missing = str(tmp_path / "missing.txt")
    assert failure(missing).hint == f"{missing!r} looks like a path, read as .nsa text: no such file exists"
    assert "file" not in str(failure("branch b = window(3)")) and "path" not in str(failure("branch b = window(3)"))
