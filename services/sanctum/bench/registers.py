"""`sanctum bench registers`: what the tiled 4-bit kernel's variants cost an SM, without a GPU.

Each variant (weights 1-3 tiles ahead, 1 or 2 blocks an SM) is compiled for `--arch` with
NVRTC (the one MLX loaded on a GPU machine, else the nvidia-cuda-nvrtc-cu12 wheel's) and
ptxas's report read back: registers and spilled bytes a thread, shared memory a block, and
from those the thread blocks an SM can hold at once (sm_90's limits: an H100 or H200). A
variant that needs more than 128 registers a thread holds one block of 256 threads an SM
instead of two, and the tiled kernel's grid aims at two an SM (qmm_cuda.TILED_BLOCKS).
"""

from __future__ import annotations

import json

from ..engine.kernels import build, qmm_cuda

# an sm_90 SM: registers (allocated 256 a warp at a time), shared memory (1 KB of it reserved
# a block), threads, blocks
SM90 = {"registers": 65536, "smem_bytes": 233472, "threads": 2048, "blocks": 32}
VARIANTS = [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2)]  # (tiles ahead, blocks an SM asked for)


def blocks_per_sm(registers: int, smem_bytes: int, threads: int = 32 * qmm_cuda.WARPS) -> int:
    """Thread blocks of `threads` an sm_90 SM holds at once with these resources."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM90["registers"] // (per_warp * (threads // 32))
    by_smem = SM90["smem_bytes"] // (smem_bytes + 1024)
    return min(by_registers, by_smem, SM90["threads"] // threads, SM90["blocks"])


def run(args) -> list[dict]:
    compiler = None
    if args.arch == "this-gpu":  # the NVRTC MLX loaded, whether or not kernels are kept
        try:
            compiler = build.Compiler.find()
        except Exception:  # no GPU here, or no NVRTC beside MLX: the wheel's, below
            compiler = None
    if compiler is None:
        arch = "sm_90" if args.arch == "this-gpu" else args.arch
        compiler = build.Compiler.from_wheels(arch)
    if compiler is None:
        raise SystemExit(
            "no NVRTC: install the dev extras (nvidia-cuda-nvrtc-cu12) or run on a GPU"
        )
    rows = []
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        for M in (int(v) for v in args.rows.split(",")):
            for ahead, resident in VARIANTS:
                r = qmm_cuda.tiled_resources(compiler, M, K, N, ahead=ahead, resident=resident)
                rows.append(
                    {
                        "N x K": shape,
                        "rows": M,
                        "ahead": ahead,
                        "resident": resident,
                        **r,
                        "blocks_an_sm": blocks_per_sm(r["registers"], r["smem_bytes"]),
                    }
                )
                if args.lines:
                    print(json.dumps({"arch": compiler.arch, **rows[-1]}), flush=True)
    return rows


def add_parser(bsub) -> None:
    r = bsub.add_parser(
        "registers", help="the tiled 4-bit kernel's registers and blocks an SM, compiled only"
    )
    r.add_argument("--shapes", default="17408x5120,5120x17408", help="N x K, comma-separated")
    r.add_argument("--rows", default="64,32")
    r.add_argument("--arch", default="this-gpu", help="sm_XY (default: this GPU's, else sm_90)")
    r.add_argument("--lines", action="store_true", help="a JSON line per variant as it is read")
    r.add_argument("--json", action="store_true")
