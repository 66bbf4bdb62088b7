"""The wheel carries templates and grammar: build it, install it into a fresh venv, run nsa-compile there."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(command: list[str | Path], *, timeout: int, **kwargs: object) -> str:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_installed_wheel_compiles_an_example(tmp_path: Path) -> None:
    # --no-isolation: build with this interpreter's hatchling (the test extra) instead of downloading it.
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", tmp_path / "dist", ROOT], timeout=300)
    (wheel,) = (tmp_path / "dist").glob("nsa_dsl-*.whl")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], timeout=300)
    python, pip = venv / "bin" / "python", venv / "bin" / "pip"
    run([pip, "install", "--no-deps", "--no-index", wheel], timeout=300)
    # The dependencies (jax, lark, ...) come from this interpreter, without network: its site-packages
    # and its PYTHONPATH but the checkout (the GPU machine keeps lark and jax-triton in a --target
    # folder there). A .pth file appends them after the venv's own site-packages, so the installed
    # nsa_dsl is the one imported (PYTHONPATH would put them, and the checkout's nsa_dsl, in front).
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=60).strip()
    outer = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    Path(purelib, "outer_site_packages.pth").write_text("\n".join(outer + site.getsitepackages()) + "\n")

    elsewhere = tmp_path / "elsewhere"  # not the checkout, whose templates/ must not be found
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["NSA_DSL_CACHE_DIR"] = str(tmp_path / "cache")
    shipped = run(
        [python, "-c", "import nsa_dsl.resources as r; print(r.templates_dir()); print(r.grammar_path())"],
        timeout=120,
        cwd=elsewhere,
        env=env,
    ).split()
    assert shipped == [
        str(Path(purelib, "nsa_dsl", "_templates")),
        str(Path(purelib, "nsa_dsl", "_grammars", "nsa.lark")),
    ]
    assert Path(shipped[0], "xla", "module.py.j2").is_file()
    # The caching ptxas wrapper runs from the package (runtime/ptxas_cache.py): executable as installed.
    assert os.access(Path(purelib, "nsa_dsl", "runtime", "bin", "ptxas"), os.X_OK)

    output = run(
        [venv / "bin" / "nsa-compile", ROOT / "examples" / "longformer.nsa", "-o", "out"],
        timeout=300,
        cwd=elsewhere,
        env=env,
    )
    generated = elsewhere / "out" / "longformer_xla.py"
    assert generated.is_file() and str(generated.relative_to(elsewhere)) in output
    assert str(tmp_path / "cache") in output
    # The written module imports in the installed environment.
    run([python, "-c", "import longformer_xla"], timeout=300, cwd=generated.parent, env=env)

    # The quickstart, beside a copy of its pattern outside the checkout, runs on the installed package.
    for name in ("quickstart.py", "longformer.nsa"):
        shutil.copy(ROOT / "examples" / name, elsewhere)
    printed = run([python, "quickstart.py", "--seq-len", "256"], timeout=300, cwd=elsewhere, env=env)
    error = float(re.search(r"max relative error vs float64 reference: (\S+)", printed).group(1))
    assert error <= 1e-5
