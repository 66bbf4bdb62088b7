"""bench_gpu.py's PyTorch worker: flash-linear-attention's parallel_nsa and FlexAttention, timed
in a process that imports no JAX.

Started by bench_gpu.py (`python benchmarks/bench_gpu_torch.py --device cuda`); reads one JSON
request a line on stdin, answers one JSON line on stdout:

  request  {"impl": "fla" | "flex", "case": "selection" | "nsa" | "window", "mode": "fwd" | "fwdbwd",
            "inputs": DIR, "settings": {"block": ..., "selected": ..., "window": ..., "scale": ...},
            "probe": {"tokens": [...], "heads": [...], "dims": N} | null, "timing": {measure()'s options}}
  answer   {"ok": true, "result": {timing.measure()'s dict}, "probe": [[[...]]] | null (fwd: o's samples,
            fwdbwd: dq's), "probe_error": "..." where taking them failed}
           {"ok": false, "error": "...", "traceback": "..."}

The first line it writes is {"ready": true, "versions": {...}}, or {"ready": false, "error": ...}
before it exits when PyTorch cannot start. Inputs are the arrays the JAX
process drew, saved by it under DIR (meta.json names each file and dtype), so every
implementation sees the same values. Anything a library prints goes to stderr: stdout carries
only the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from importlib import metadata

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import error_text, measure


def load_inputs(directory: str, device: str) -> dict:
    """The arrays of one sequence length as torch tensors on `device`."""
    import torch

    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    tensors = {}
    for name, entry in meta["arrays"].items():
        array = np.load(os.path.join(directory, entry["file"]))
        if entry["dtype"] == "bfloat16":  # saved as its raw 16-bit patterns: numpy has no bfloat16
            tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(array)
        tensors[name] = tensor.to(device)
    return tensors


class Worker:
    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.inputs_dir = None
        self.inputs = {}
        self.flex = None
        self.block_masks = {}

    def sync(self, _result) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def use_inputs(self, directory: str) -> dict:
        if directory != self.inputs_dir:
            self.inputs, self.block_masks = {}, {}
            if self.device == "cuda":
                self.torch.cuda.empty_cache()
            self.inputs = load_inputs(directory, self.device)
            self.inputs_dir = directory
        return self.inputs

    def fla_forward(self, case: str, x: dict, settings: dict):
        from fla.ops.nsa import parallel_nsa

        q, k, v = x["q_grad"], x["k_grad"], x["v_grad"]
        # Packed sequences where the JAX process drew them (block ids count from each one's start).
        cu_seqlens = x["cu_seqlens"].long() if "cu_seqlens" in x else None
        if case == "selection":
            # Per-token counts of the real entries (the rest are -1, which FLA's kernels skip).
            indices, counts = x["block_indices"].long(), x["block_counts"].long()
            return lambda: parallel_nsa(q, k, v, block_indices=indices, block_counts=counts,
                                        block_size=settings["block"], scale=settings["scale"], cu_seqlens=cu_seqlens)
        if case == "nsa":
            # Compression, top-k and selection computed by FLA itself: g_cmp given, no indices.
            # No window branch: FLA's needs flash_attn, which the image does not have.
            g_cmp, g_slc = x["g_cmp"], x["g_slc"]
            return lambda: parallel_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_indices=None,
                                        block_counts=settings["selected"], block_size=settings["block"],
                                        scale=settings["scale"], cu_seqlens=cu_seqlens)
        raise ValueError(f"fla has no {case!r} case here")

    def flex_forward(self, case: str, x: dict, settings: dict, grad: bool):
        torch = self.torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if case != "window" or "cu_seqlens" in x:
            raise ValueError(f"flex has no {case!r} case here" + (" on packed sequences" if "cu_seqlens" in x else ""))
        if self.flex is None:
            # Compiled as FlexAttention is meant to run; on the CPU (dry runs) eagerly.
            self.flex = torch.compile(flex_attention, dynamic=False) if self.device == "cuda" else flex_attention
        seq_len, window = x["q"].shape[1], settings["window"]
        key = (seq_len, window)
        if key not in self.block_masks:
            def sliding_window(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

            self.block_masks[key] = create_block_mask(sliding_window, None, None, seq_len, seq_len, device=self.device)
        mask = self.block_masks[key]
        # FlexAttention's layout is [B, H, T, D]: transposed copies made once, outside the timing.
        q, k, v = (x[f"{name}_bhtd" + ("_grad" if grad else "")] for name in ("q", "k", "v"))

        def forward():
            out = self.flex(q, k, v, block_mask=mask, scale=settings["scale"], enable_gqa=True)
            return out.transpose(1, 2)
        return forward

    @staticmethod
    def prepare(impl: str, x: dict) -> None:
        """Differentiable leaves (and FlexAttention's layout) made once per input set."""
        for name in ("q", "k", "v"):
            if f"{name}_grad" not in x:
                x[f"{name}_grad"] = x[name].detach().requires_grad_()
            if impl == "flex" and f"{name}_bhtd" not in x:
                x[f"{name}_bhtd"] = x[name].transpose(1, 2).contiguous()
                x[f"{name}_bhtd_grad"] = x[f"{name}_bhtd"].detach().requires_grad_()

    def handle(self, request: dict) -> dict:
        torch = self.torch
        x = self.use_inputs(request["inputs"])
        impl, case, mode, settings = request["impl"], request["case"], request["mode"], request["settings"]
        self.prepare(impl, x)
        grad = mode == "fwdbwd"
        forward = self.fla_forward(case, x, settings) if impl == "fla" else self.flex_forward(case, x, settings, grad)
        timing = request.get("timing", {})
        if mode == "fwd":
            def call():
                with torch.no_grad():
                    return forward()
        else:
            leaves = tuple(x[f"{n}_bhtd_grad" if impl == "flex" else f"{n}_grad"] for n in "qkv")
            d_out = x["do"]

            def call():
                out = forward()
                return out, torch.autograd.grad(out, leaves, d_out.to(out.dtype))
        result = measure(call, self.sync, **timing)
        answer = {"ok": True, "result": result, "probe": None}
        if request.get("probe"):
            # The forward's sampled output, or forward+backward's sampled dq ([B, T, HQ, D]; Flex's
            # comes as [B, HQ, T, D]). A probe that fails leaves the timing standing.
            try:
                spec = request["probe"]
                if mode == "fwd":
                    with torch.no_grad():
                        out = forward()
                else:
                    out = call()[1][0]
                    if impl == "flex":
                        out = out.transpose(1, 2)
                tokens = torch.tensor(spec["tokens"], device=out.device)
                heads = torch.tensor(spec["heads"], device=out.device)
                answer["probe"] = (out[0].index_select(0, tokens).index_select(1, heads)[..., : spec["dims"]]
                                   .float().cpu().tolist())
            except Exception as err:  # noqa: BLE001 - the row keeps its time, without a probe
                answer["probe_error"] = error_text(err)
                traceback.print_exc(limit=6)
        return answer


def versions(device: str) -> dict:
    import torch

    found = {"torch": torch.__version__, "device": device}
    if device == "cuda":
        found["gpu"] = torch.cuda.get_device_name(0)
    for name in ("fla-core", "triton"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    # The protocol keeps the real stdout; whatever else writes to fd 1 lands on stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        worker = Worker(args.device)
        hello = {"ready": True, "versions": versions(args.device)}
    except Exception as err:  # noqa: BLE001 - told to the parent, which stops asking
        traceback.print_exc(limit=6)
        protocol.write(json.dumps({"ready": False, "error": error_text(err)}) + "\n")
        sys.exit(1)
    protocol.write(json.dumps(hello) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = worker.handle(json.loads(line))
        except Exception as err:  # noqa: BLE001 - a failing peer is an answer; the worker goes on
            answer = {"ok": False, "error": error_text(err), "traceback": traceback.format_exc(limit=6)}
            traceback.print_exc(limit=6)
        protocol.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
