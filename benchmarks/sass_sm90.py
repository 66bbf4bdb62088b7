"""Instruction counts of one generated Triton kernel compiled for an H100/H200 (sm_90a) on a machine
without a GPU: the tool behind session 14's top-k change (NOTES.md, "Session 14 contracts").

    PYTHONPATH=. python benchmarks/sass_sm90.py KERNEL [--case JSON] [--out DIR]

KERNEL: a kernel name (topk_selection, compression_forward, selection_forward, ...). --case: one
case as tests/triton_sm90.py takes them (default: issue 4's shape at 64k tokens, compress(64, 64)
with a top-16 of 64-token blocks). Traces the case's forward and backward (triton_sm90's
record_launches), compiles the kernel's first recorded launch for sm_90a, writes KERNEL.sass and
KERNEL.ttgir to --out and prints its launch settings, registers, shared memory and SASS opcode
histogram. In the ttgir, a layout whose `lane` bases include [0, ...] holds each element on several
lanes: work done once per lane, not per element.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones

import triton  # noqa: E402
import triton_sm90  # noqa: E402 - records launches instead of running them
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools import disasm  # noqa: E402

# Triton's SASS listing matches instruction addresses of exactly four hex digits, so it drops every
# instruction of a kernel past its first 64 KB (4096 instructions) without a word: take any width.
disasm.FLINE_RE = re.compile(disasm.FLINE_RE.pattern.replace(r"\w{4}", r"\w{4,}"))

NSA_64K = {
    "pattern": "pattern nsa_stage\nblock 64\ncausal\n"
    "branch cmp = compress(block=64, stride=64) gate g_cmp\n"
    "branch slc = topk(16, block=64, score=cmp, force=global(first=1) | local(2)) gate g_slc\n",
    "batch": 1, "seq_len": 65536, "heads_q": 64, "heads_kv": 4, "head_dim": 128, "dtype": "bfloat16",
}
OPCODE = re.compile(r"\S+\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def registers(cubin_path: str) -> str:
    """The kernel's resource line as the cuobjdump shipped with Triton prints it."""
    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", cubin_path], capture_output=True, text=True, check=True)
    return next((line.strip() for line in usage.stdout.splitlines() if "REG:" in line), "?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel")
    parser.add_argument("--case", type=json.loads, default=NSA_64K)
    parser.add_argument("--out", default=".")
    parser.add_argument("--maxnreg", type=int, help="cap the registers a thread (Triton's maxnreg): does the kernel "
                        "fit under a budget without spilling (STACK, LDL/STL in the output)?")
    args = parser.parse_args()

    triton_sm90.record_launches([args.case])
    entry = next((e for e in triton_sm90.recorded.values() if e["kernel"].__name__ == args.kernel), None)
    if entry is None:
        names = sorted({e["kernel"].__name__ for e in triton_sm90.recorded.values()})
        sys.exit(f"{args.kernel} is not launched by this case; it launches {', '.join(names)}")
    source = ASTSource(entry["kernel"], entry["signature"], entry["constexprs"], entry["attrs"])
    options = dict(entry["options"], **({"maxnreg": args.maxnreg} if args.maxnreg else {}))
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.kernel)
    sass = disasm.get_sass(compiled.asm["cubin"])
    for suffix, text in ((".sass", sass), (".ttgir", compiled.asm["ttgir"])):
        with open(stem + suffix, "w") as f:
            f.write(text)
    with open(stem + ".cubin", "wb") as f:
        f.write(compiled.asm["cubin"])
    opcodes = collections.Counter(
        match.group(1).split(".")[0] for match in map(OPCODE.match, sass.splitlines()) if match
    )
    print(f"{args.kernel}: {options}, shared {compiled.metadata.shared} B, {registers(stem + '.cubin')}")
    print(f"{sum(opcodes.values())} instructions:", ", ".join(f"{op} {n}" for op, n in opcodes.most_common(30)))


if __name__ == "__main__":
    main()
