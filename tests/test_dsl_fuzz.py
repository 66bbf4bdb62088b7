"""Fuzzing the .nsa front end: whatever the text, load() returns patterns or raises one of
nsa_dsl's own errors, located inside the text, never anything else."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from nsa_dsl.dsl import load, model
from nsa_dsl.errors import NsaError

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.nsa"))
EXAMPLE_TEXTS = [path.read_text() for path in EXAMPLES]
TOKENS = (
    "pattern param block causal bidirectional gate branch default per token if true false "
    "window local stride global blocks random compress topk score force first every offset left right "
    "before after count seed pool mean cmp slc main g_cmp g_slc g_x lambda class "
    "0 1 2 3 16 64 512 -1 1.5 .5 1e999 99999999999999999999 ( ) , = | & - + * / // # @"
).split() + ["\n", " ", "\t", "\r\n"]
LEXEMES = re.compile(r"\w+|//|\s+|\S")
SETTINGS = settings(max_examples=120, deadline=None)


def outcome(text: str, **kwargs) -> None:
    try:
        patterns = load(text, **kwargs)
    except NsaError as err:
        str(err)  # the message always formats
        if err.line is not None:
            lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # LF, CRLF and CR each end a line
            assert 1 <= err.line <= len(lines)
            assert 1 <= err.column <= len(lines[err.line - 1]) + 1
            assert err.source_line == lines[err.line - 1]
        return
    assert patterns and all(isinstance(p, model.Pattern) for p in patterns)
    for pattern in patterns:
        assert pattern.branches and pattern.block_size >= 16


@st.composite
def mutated_examples(draw) -> str:
    text = draw(st.sampled_from(EXAMPLE_TEXTS))
    for _ in range(draw(st.integers(1, 4))):
        lexemes = LEXEMES.findall(text)
        kind = draw(
            st.sampled_from(
                ["insert char", "delete chars", "replace char", "insert token", "delete token", "replace token"]
            )
        )
        if kind.endswith("token"):
            at = draw(st.integers(0, len(lexemes)))
            token = draw(st.sampled_from(TOKENS))
            if kind == "insert token":
                lexemes.insert(at, token)
            elif at < len(lexemes):
                lexemes[at : at + 1] = [] if kind == "delete token" else [token]
            text = "".join(lexemes)
        else:
            at = draw(st.integers(0, len(text)))
            if kind == "insert char":
                text = text[:at] + draw(st.characters()) + text[at:]
            elif kind == "delete chars":
                text = text[:at] + text[at + draw(st.integers(1, 8)) :]
            else:
                text = text[:at] + draw(st.characters()) + text[at + 1 :]
    return text


@SETTINGS
@given(mutated_examples())
def test_mutated_examples(text):
    outcome(text)


@SETTINGS
@given(
    st.one_of(
        st.text(alphabet=st.sampled_from("patrmblockusdvignhewfx_0123456789()=,|&-+*/#.\n \t"), max_size=120),
        st.lists(st.sampled_from(TOKENS), max_size=40).map(" ".join),
        st.text(max_size=60),
    )
)
def test_random_text(text):
    outcome(text)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(
        EXAMPLE_TEXTS
        + ["pattern p\nparam w = 4\nparam f = 0.5\nparam on = true\nblock 64\nbranch b = local(w) if on\n"]
    ),
    st.dictionaries(
        st.sampled_from(["w", "f", "on", "window", "seed", "every", "x"]),
        st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.booleans(), st.text(max_size=6), st.none()),
        max_size=3,
    ),
)
def test_random_overrides(text, overrides):
    outcome(text, overrides=overrides)
