"""Where the language grammar and the kernel templates live.

In a source checkout they are the top-level `grammars/` and `templates/` folders; a wheel
ships them inside the package as `nsa_dsl/_grammars` and `nsa_dsl/_templates`.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PACKAGE / f"_{name}", _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"nsa_dsl installation is missing its {name}/ folder (looked in {_PACKAGE})")


def templates_dir() -> Path:
    return _find("templates")


def grammar_path() -> Path:
    return _find("grammars") / "nsa.lark"
