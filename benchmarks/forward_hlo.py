"""Which source line made each kernel of a jitted forward: bench_gpu's full NSA pattern at one length
(forward_timeline.py's forward), compiled by XLA, its optimized HLO written to OUT/hlo_optimized.txt
and its entry's launches (fusions and custom calls, in launch order) listed with the source frames
the HLO carries for them: the generated module's line (<module>.py) or nsa_dsl's. Pair it with
forward_timeline.py's ncu times, which name the same fusions (session 54:
benchmarks/results/small_kernels_64k_nsa_2026-12-04s54b.txt).

    python3 benchmarks/forward_hlo.py 65536 OUT       # on the GPU: XLA's GPU pipeline makes the fusions
"""

from __future__ import annotations

import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def section(text: str, name: str) -> list[str]:
    """The lines of one of the HLO text's trailing tables (FileNames, StackFrames, ...)."""
    return text.split("\n" + name + "\n", 1)[1].split("\n\n", 1)[0].splitlines()


def frame_sources(text: str) -> dict[int, str]:
    """Each stack frame id of the HLO as 'file:function:line <- caller's ...', innermost first."""
    files = {int(line.split()[0]): os.path.basename(line.split()[1].strip('"')) for line in section(text, "FileNames")}
    files = {k: "<module>.py" if re.fullmatch(r"[0-9a-f]{64}\.py", v) else v for k, v in files.items()}
    functions = {int(line.split()[0]): line.split(None, 1)[1].strip('"') for line in section(text, "FunctionNames")}
    locations = {}
    for line in section(text, "FileLocations"):
        m = re.match(r"(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", line)
        locations[int(m[1])] = f"{files[int(m[2])]}:{functions[int(m[3])]}:{m[4]}"
    frames = {}
    for line in section(text, "StackFrames"):
        m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", line)
        frames[int(m[1])] = (int(m[2]), int(m[3]))

    def chain(frame: int) -> str:
        names = []
        while frame in frames and len(names) < 3:
            location, parent = frames[frame]
            names.append(locations[location])
            if parent == frame:
                break
            frame = parent
        return " <- ".join(names)

    return {frame: chain(frame) for frame in frames}


def launches(text: str) -> list[str]:
    """The entry computation's fusions and custom calls, in order, with their shapes and sources."""
    sources = frame_sources(text)
    entry = text.split("\nENTRY", 1)[1].split("\n}\n", 1)[0]
    rows = []
    for line in entry.splitlines():
        m = re.match(r"\s*%(\S+) = (\(.*?\)|\S+) (?:fusion|custom-call)\(", line)
        if m:
            target = re.search(r'custom_call_target="([^"]+)"', line)
            frame = re.search(r"stack_frame_id=(\d+)", line)
            source = sources.get(int(frame[1]), "") if frame else ""
            rows.append(f"{m[1]:40s} {m[2][:44]:44s} {target[1] if target else '':22s} {source}")
    return rows


def main() -> None:
    length, out = int(sys.argv[1]), sys.argv[2]
    from forward_timeline import forward_and_inputs

    forward, args = forward_and_inputs(length)
    text = forward.lower(*args).compile().as_text()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "hlo_optimized.txt"), "w") as f:
        f.write(text)
    print("\n".join(launches(text)))


if __name__ == "__main__":
    main()
