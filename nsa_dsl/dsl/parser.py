"""Text to syntax tree: Lark's LALR parser over grammars/nsa.lark, then a Transformer that
builds the typed nodes of `dsl.ast`. Lark's own errors become `NsaSyntaxError`s that quote
the line, put a caret under the column and say in words what could have come there."""

from __future__ import annotations

import codecs
import functools
import os
import re
from pathlib import Path

from lark import Lark, Token, Transformer_NonRecursive, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError

from ..errors import NsaError, NsaSyntaxError
from ..resources import grammar_path
from . import ast

_INT_LIMIT = 2**63  # integer literals must be below it; larger ones mean nothing to any kernel

_COMMENT = re.compile(r"#[^\n]*")
_TERMINAL_WORDS = {"NAME": "a name", "INT": "an integer", "FLOAT": "a decimal number", "$END": "end of input"}


@functools.cache
def _lark() -> Lark:
    return Lark(
        grammar_path().read_text(encoding="utf-8"), parser="lalr", propagate_positions=True, maybe_placeholders=True
    )


def parse(text: str, *, file: str = "<string>") -> ast.Module:
    """The syntax tree of `text`; raises NsaSyntaxError if it is not a `.nsa` module."""
    # Lark counts lines by \n alone: text with CR or CRLF line ends (a file read with newline="", an old
    # Mac editor's) would report every position on line 1.
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as err:
        raise _syntax_error(err, text, file) from None
    try:
        patterns = _ToAst(file, text).transform(tree)
    except VisitError as err:
        if isinstance(err.orig_exc, NsaError):
            raise err.orig_exc from None
        raise
    return ast.Module(file=file, source=text, patterns=patterns)


# ---- parse tree -> ast ---------------------------------------------------------------------
@v_args(meta=True)
class _ToAst(Transformer_NonRecursive):
    """Builds `dsl.ast` nodes bottom-up (without recursion, so deep expressions are safe)."""

    def __init__(self, file: str, source: str) -> None:
        super().__init__()
        self._file = file
        self._source = source

    def start(self, meta, patterns):
        return tuple(patterns)

    def pattern(self, meta, children):
        name, *statements = children
        return ast.Pattern(_identifier(name), tuple(statements), meta.line, meta.column)

    def param(self, meta, children):
        name, value = children
        return ast.Param(_identifier(name), value, meta.line, meta.column)

    def block_size(self, meta, children):
        return ast.BlockSize(children[0], meta.line, meta.column)

    def causal(self, meta, children):
        return ast.Masking(True, meta.line, meta.column)

    def bidirectional(self, meta, children):
        return ast.Masking(False, meta.line, meta.column)

    def gate_decl(self, meta, children):
        return ast.GateDecl(_identifier(children[0]), meta.line, meta.column)

    def branch(self, meta, children):
        name, value, *options = children
        return ast.Branch(_identifier(name), value, tuple(options), meta.line, meta.column)

    def gate_clause(self, meta, children):
        name, default = children
        return ast.GateClause(
            _identifier(name), None if default is None else self._number(default), meta.line, meta.column
        )

    def per_token(self, meta, children):
        return ast.PerToken(meta.line, meta.column)

    def per_block(self, meta, children):
        return ast.PerBlock(children[0], meta.line, meta.column)

    def if_clause(self, meta, children):
        return ast.IfClause(_identifier(children[0]), meta.line, meta.column)

    # expressions
    def int(self, meta, children):
        return self._number(children[0])

    def float(self, meta, children):
        return self._number(children[0])

    def _number(self, token: Token) -> ast.IntLiteral | ast.FloatLiteral:
        if token.type == "FLOAT":
            return ast.FloatLiteral(float(token.value), token.line, token.column)
        # Leading zeros change no number; converting without them also keeps int() clear of its
        # 4300-digit limit, which the length check below guards for the digits that remain.
        digits = token.value.lstrip("0") or "0"
        if len(digits) > len(str(_INT_LIMIT)) or int(digits) >= _INT_LIMIT:
            raise NsaSyntaxError(
                "integer literal too large",
                file=self._file,
                line=token.line,
                column=token.column,
                source_line=source_line(self._source, token.line),
                hint="integers must be below 2**63",
            )
        return ast.IntLiteral(int(digits), token.line, token.column)

    def true(self, meta, children):
        return ast.BoolLiteral(True, children[0].line, children[0].column)

    def false(self, meta, children):
        return ast.BoolLiteral(False, children[0].line, children[0].column)

    def name(self, meta, children):
        (token,) = children
        return ast.Name(token.value, token.line, token.column)

    def call(self, meta, children):
        function, arguments = children
        return ast.Call(function.value, arguments or (), function.line, function.column)

    def arguments(self, meta, children):
        return tuple(
            child if isinstance(child, ast.Argument) else ast.Argument(None, child, child.line, child.column)
            for child in children
        )

    def keyword_argument(self, meta, children):
        keyword, value = children
        return ast.Argument(keyword.value, value, keyword.line, keyword.column)

    def binary(self, meta, children):
        left, operator, right = children
        return ast.Binary(operator.value, left, right, operator.line, operator.column)

    def negate(self, meta, children):
        operator, operand = children
        return ast.Negate(operand, operator.line, operator.column)


def _identifier(token: Token) -> ast.Identifier:
    return ast.Identifier(token.value, token.line, token.column)


# ---- Lark errors -> NsaSyntaxError ---------------------------------------------------------
def _syntax_error(err: UnexpectedInput, text: str, file: str) -> NsaSyntaxError:
    misread = _keyword_taken_as_name(err)
    if misread is not None:
        # The contextual lexer read a keyword as a name where only a name fits (`gate` then
        # `branch ...`), so the error would land on a later token: say what is missing instead.
        keyword, before = misread
        return NsaSyntaxError(
            f"expected a name after {before}, found the keyword '{keyword.value}'",
            file=file, line=keyword.line, column=keyword.column, source_line=source_line(text, keyword.line),
            hint=f"'{keyword.value}' is a keyword of the language, never a name: is the name missing?",
        )
    if isinstance(err, UnexpectedCharacters):
        message = f"unexpected character {err.char!r}"
        line, column = err.line, err.column
    elif isinstance(err, UnexpectedToken) and err.token.type != "$END":
        token = err.token
        message = f"unexpected {_describe_token(token)}"
        line, column = token.line, token.column
    else:  # UnexpectedToken at $END, or UnexpectedEOF
        message = "unexpected end of input"
        line, column = _end_position(text)
    # Lark's own `expected` sets are LALR's merged lookaheads, which can list terminals that
    # would fail one reduction later; accepts() tries each one from the failing state.
    words = _expected_words(err.interactive_parser.accepts())
    hint = ("expected " + (words[0] if len(words) == 1 else "one of: " + ", ".join(words))) if words else None
    return NsaSyntaxError(message, file=file, line=line, column=column, source_line=source_line(text, line), hint=hint)


def _keyword_taken_as_name(err: UnexpectedInput) -> tuple[Token, str] | None:
    """(the keyword, what came before it as words) where the parse failed right after a keyword
    read as a name; None otherwise."""
    if not isinstance(err, UnexpectedToken) or err.interactive_parser is None:
        return None
    values = err.interactive_parser.parser_state.value_stack
    last = values[-1] if values else None
    if not (isinstance(last, Token) and last.type == "NAME" and last.value in _keywords()):
        return None
    before = values[-2] if len(values) > 1 else None
    return last, f"'{before.value}'" if isinstance(before, Token) else "what precedes it"


@functools.cache
def _keywords() -> frozenset[str]:
    """The grammar's words (`branch`, `gate`, `true`, ...): its terminals that are literal names."""
    return frozenset(
        t.pattern.value for t in _lark().terminals if t.pattern.type == "str" and t.pattern.value.isidentifier()
    )


def _describe_token(token: Token) -> str:
    kind = {"NAME": "name ", "INT": "integer ", "FLOAT": "number "}.get(token.type, "")
    return f"{kind}'{token.value}'"


def _expected_words(terminal_names) -> list[str]:
    """Readable words for Lark's terminal names: RPAR -> "')'", NAME -> "a name"."""
    words = sorted(_TERMINAL_WORDS[name] for name in terminal_names if name in _TERMINAL_WORDS)
    # every other terminal is a literal string: a keyword or punctuation
    literals = sorted(
        f"'{_lark().get_terminal(name).pattern.value}'" for name in terminal_names if name not in _TERMINAL_WORDS
    )
    return words + literals


def _end_position(text: str) -> tuple[int, int]:
    """Line and column just after the last non-blank, non-comment character of `text`."""
    lines = text.split("\n")
    for index in range(len(lines) - 1, -1, -1):
        # comments blanked in place, so that the columns of what precedes them stay as they are
        content = _COMMENT.sub(lambda comment: " " * len(comment[0]), lines[index]).rstrip(" \t\f")
        if content:
            return index + 1, len(content) + 1
    return 1, 1


def source_line(text: str, line: int) -> str | None:
    """Line `line` (1-based) of `text` (its line ends \\n alone, as `parse` makes them)."""
    lines = text.split("\n")
    return lines[line - 1] if 1 <= line <= len(lines) else None


def read(source: str | os.PathLike, *, file: str | None = None) -> ast.Module:
    """Parse a `.nsa` file (a PathLike, or a one-line str ending in ".nsa") or `.nsa` text.
    `file` names the source in error messages (default: the path, or "<string>")."""
    if isinstance(source, os.PathLike) or (isinstance(source, str) and source.endswith(".nsa") and "\n" not in source):
        path = Path(source)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise NsaError(f"cannot read {str(path)!r}: {err.strerror or err}", file=file or str(path)) from None
        return parse(_decoded(data, file or str(path)), file=file or str(path))
    if isinstance(source, str):
        try:
            return parse(source, file=file or "<string>")
        except NsaSyntaxError as err:
            hint = _path_hint(source.strip())
            if hint is None:
                raise
            raise NsaSyntaxError(
                err.message, file=err.file, line=err.line, column=err.column, source_line=err.source_line, hint=hint
            ) from None
    raise TypeError(f"source must be .nsa text or a path to a .nsa file, got {type(source).__name__}")


def _path_hint(text: str) -> str | None:
    """A hint for .nsa text that did not parse and is one line that names a file or looks like a
    path (a str is read as a path only when it is one line ending in .nsa); None otherwise."""
    if "\n" in text:
        return None
    if os.path.isfile(text):
        return (f"{text!r} names a file, read as .nsa text: pass pathlib.Path({text!r}) to read the file "
                "(a str is a path only when it is one line ending in .nsa)")
    if "/" in text or os.sep in text or text.endswith(".nsa"):
        return f"{text!r} looks like a path, read as .nsa text: no such file exists"
    return None


def _decoded(data: bytes, file: str) -> str:
    """A file's bytes as text (UTF-8; a byte order mark, as some editors write, is no text), or an
    error at the line and column of the first byte that is not UTF-8."""
    # Line ends as parse() reads them, so that a line counts alike here (CR and LF are never
    # part of a multi-byte UTF-8 character).
    data = data.removeprefix(codecs.BOM_UTF8).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        line_end = data.find(b"\n", err.start)
        raise NsaError(
            f"not UTF-8 text: byte 0x{data[err.start]:02x} ({err.reason})",
            file=file,
            line=data.count(b"\n", 0, err.start) + 1,
            column=len(data[line_start : err.start].decode("utf-8", "replace")) + 1,
            source_line=data[line_start : None if line_end < 0 else line_end].decode("utf-8", "replace"),
            hint="save the file as UTF-8",
        ) from None
