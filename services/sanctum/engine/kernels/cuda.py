"""What runs differently on NVIDIA GPUs (MLX's CUDA backend), decided once, at import and at
load, and said loudly (log lines, and `report()` for the benchmarks).

- cuDNN SDPA off: MLX sends multi-row bf16/fp16 attention with head_dim <= 128 to cuDNN, which
  builds an execution plan for every new key length (every verify round, every draft) and
  aborts the process once its plan cache has missed 512 times.
  Importing this module sets MLX_CUDA_USE_CUDNN_SDPA=0 (and the older SPDA spelling) unless the
  environment already sets it; MLX's own kernels (one-row vector kernel, composed ops) run those
  calls instead. It must happen before the first attention call (the flag is read once).
- Q8 KV: MLX CUDA lacks `quantized_matmul` for the attention's shapes, so mlx-lm's quantized
  SDPA fails there; the attention reads dequantized copies of the 8-bit K/V (the cache itself,
  and what the prompt cache saves, stay 8-bit). SANCTUM_Q8_ATTENTION=auto|quantized|dequantized
  picks on any device (auto: dequantized on CUDA only).
- Gated DeltaNet over a block: the fused kernel of gdn_cuda.py, compared at load with the MLX
  path on this GPU (`prepare`) and used only when they agree; SANCTUM_GDN_KERNEL=off keeps the
  MLX path. The comparison runs in a child process (a kernel that fails to build could leave
  this process's GPU stream unusable) and is remembered per MLX version and kernel source in
  $SANCTUM_HOME/cuda-checks.json.
- 4-bit matmuls of 2..16 rows (a verify block, the draft head): qmm_cuda.py's kernel, which
  reads the weights once for all rows (MLX CUDA's runs a one-row kernel per row there);
  a shared verify's 17..64 rows too, 16 a call, checked the same way, correct and faster than
  MLX's, before it is used (`prepare_linear`; figures: docs/performance.md), or all of them in
  one call by its wide variant once that passed its own check and speed gate against 16 a
  call (SANCTUM_QMM_WIDE=off keeps 16 a call); SANCTUM_QMM_KERNEL=off keeps MLX's for all. (The narrow GDN gate projections, which MLX
  sends to a naive kernel at several rows, are fused with their siblings: engine/kernels/fused.py.)
- A draft layer's block attention and DFlash 2 convolutions: draft_cuda.py's kernels, checked
  the same way on the body's own shapes (`prepare_drafter`); SANCTUM_DRAFT_KERNELS=off keeps
  MLX's ops.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask

from ... import settings
from . import build, draft_cuda, gdn_cuda, platform, qmm_cuda

log = logging.getLogger("sanctum.cuda")
Q8_MODES = ("auto", "quantized", "dequantized")
_checked: dict = {}  # (Hk, Hv, Dk, Dv, dtype) -> None (agrees) or why not
# the GDN block kernel in force: whether it is, and whether compiled graphs may take it
_gdn = {"in_use": False, "in_compile": True}


def is_cuda() -> bool:
    """The device path is an NVIDIA GPU's (MLX's CUDA backend)."""
    return platform.current().is_cuda


def _disable_cudnn_sdpa() -> None:
    if platform._cuda_available() and not any(
        v is not None for _, v in settings.device().cudnn_sdpa
    ):
        for flag in settings.CUDNN_FLAGS:
            os.environ[flag] = "0"  # MLX reads it from the environment, at its first attention


_disable_cudnn_sdpa()


def q8_dequantized() -> bool:
    """Whether attention over an 8-bit KV cache reads dequantized K/V on this device."""
    mode = settings.device().q8_attention
    if mode not in Q8_MODES:
        raise ValueError(f"SANCTUM_Q8_ATTENTION must be one of {Q8_MODES}, got {mode!r}")
    return mode == "dequantized" or (mode == "auto" and is_cuda())


# what `prepare` hands the GDN layers: (kernel or None, it keeps every row's state, in compile,
# how a shared verify is rolled back: SANCTUM_SHARED_ROLLBACK)
InstallGDN = Callable[[Callable | None, bool, bool, str], None]


def prepare(
    gdn_shapes: set[tuple[int, int, int, int]], dtype: mx.Dtype, install: InstallGDN
) -> None:
    """At load, on CUDA: check the fused GDN kernel on the model's head shapes (Hk, Hv, Dk, Dv)
    and this activation dtype, and `install` it only when every shape agrees with the MLX path
    (`install(None, ...)` when one disagrees)."""
    if not is_cuda() or not gdn_shapes:
        return
    if settings.device().gdn_kernel == "off":
        log.warning("GDN block kernel off (SANCTUM_GDN_KERNEL=off): the MLX path runs")
        return
    problems = []
    for shape in sorted(gdn_shapes):
        if not gdn_cuda.supported(*shape):
            problems.append(f"{shape}: unsupported shape")
            continue
        key = (*shape, dtype)
        if key not in _checked:
            _checked[key] = verdict(shape, dtype)
        if _checked[key] not in (None, "eager only"):
            problems.append(f"{shape}: {_checked[key]}")
    if problems:
        install(None, False, True, "gather")
        _gdn["in_use"] = False
        log.error(
            "GDN block kernel DISAGREES with the MLX path, using MLX: %s", "; ".join(problems)
        )
        print(f"sanctum: GDN CUDA kernel disabled: {'; '.join(problems)}", file=sys.stderr)
        return
    in_compile = "eager only" not in (_checked[(*s, dtype)] for s in gdn_shapes)
    rollback = settings.device().shared_rollback
    install(gdn_cuda.gated_delta_cuda, True, in_compile, rollback)  # checked with rows' states
    _gdn.update(in_use=True, in_compile=in_compile)
    log.info("GDN block kernel checked on %s (%s): in use", sorted(gdn_shapes), dtype)


def verdict(shape: tuple[int, int, int, int], dtype: mx.Dtype) -> str | None:
    """gdn_cuda.verdict for this GPU, from a child process, remembered on disk."""
    name = str(dtype).rsplit(".", 1)[-1]
    source = hashlib.sha1(gdn_cuda.SOURCES[True].encode()).hexdigest()[:12]
    key = f"mlx {mx.__version__} kernel {source} {list(shape)} {name}"
    return _child_verdict(key, ["sanctum.engine.kernels.gdn_cuda", json.dumps(list(shape)), name])


def _child_verdict(key: str, module_args: list[str]) -> str | None:
    """The verdict a kernel module's check prints (`python -m module args`), run in a child
    process and remembered under `key` and how the kernels are built in
    $SANCTUM_HOME/cuda-checks.json."""
    key = f"{key} {build.identity()}"
    path = Path(settings.device().home) / "cuda-checks.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    cmd = [sys.executable, "-m", *module_args]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return "the check process timed out"  # not remembered: maybe a busy machine
    try:
        result = json.loads(run.stdout.strip().splitlines()[-1])["verdict"]
    except (ValueError, IndexError, KeyError, TypeError):
        result = f"the check process exited {run.returncode}: {run.stderr[-300:]}"
    known[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=1))
    except OSError:
        pass
    return result


_qmm = {"verdict": "not checked", "layers": 0}
MATRIX_ROWS = 8  # from this many rows MLX CUDA's 4-bit matmul runs its matrix kernel


def prepare_linear(model) -> None:
    """At load, on CUDA: route the few-row calls of the model's 4-bit linear layers through
    qmm_cuda's kernel once its check agreed with MLX's quantized matmul on this GPU;
    SANCTUM_QMM_KERNEL=off keeps MLX's kernel."""
    if not is_cuda():
        return
    if settings.device().qmm_kernel == "off":
        _qmm["verdict"] = "off (SANCTUM_QMM_KERNEL=off)"
        return
    source = hashlib.sha1((qmm_cuda.HEADER + qmm_cuda.SOURCE).encode()).hexdigest()[:12]
    result = _child_verdict(
        f"mlx {mx.__version__} qmm {source}", ["sanctum.engine.kernels.qmm_checks"]
    )
    _qmm["verdict"] = result or "ok"
    if result is not None:
        log.error("few-row 4-bit matmul kernel DISAGREES with MLX, not used: %s", result)
        print(f"sanctum: few-row 4-bit kernel disabled: {result}", file=sys.stderr)
        return
    qmm_cuda.SPLIT_ROWS = settings.device().qmm_split_rows
    _prepare_wide()
    layers = qmm_cuda.install(model)
    _qmm["layers"] += layers  # over every model this process loaded (report())
    log.info(
        "few-row 4-bit matmul kernel checked: %d layers of this model use it (%d loaded)",
        layers,
        _qmm["layers"],
    )


def _prepare_wide() -> None:
    """17..64 rows in one call (the weights read once): the tiled variant once its own check
    and speed gate passed on this GPU (SANCTUM_QMM_WIDE=auto; and 2..16 rows too where it
    beat the few-row kernel at 8), else the wide one once its did; a failure of both leaves
    the 16-rows-a-call path as it was."""
    mode = settings.device().qmm_wide
    if mode == "off":
        _qmm["wide"] = "off (SANCTUM_QMM_WIDE=off)"
        return
    # the gates time these kernels against each other: a verdict holds for all their sources
    sources = ("HEADER", "SOURCE", "WIDE_HEADER", "WIDE_SOURCE", "TILED_HEADER", "TILED_SOURCE")
    text = "".join(getattr(qmm_cuda, name) for name in (*sources, "SUM_SOURCE"))
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    if mode == "auto":
        ahead = settings.device().qmm_tiled_ahead
        resident = settings.device().qmm_tiled_resident
        qmm_cuda.TILED_AHEAD = _qmm["tiled_ahead"] = ahead
        qmm_cuda.TILED_RESIDENT = _qmm["tiled_resident"] = resident
        key = f"mlx {mx.__version__} qmm tiled {digest} A{ahead} R{resident}"
        args = ["sanctum.engine.kernels.qmm_checks", "tiled", str(ahead), str(resident)]
        tiled = _child_verdict(key, args)
        _qmm["tiled"] = tiled or "ok"
        if tiled is None:
            qmm_cuda.WIDE = qmm_cuda.TILED = True
            _qmm["wide"] = "tiled"
            few = _child_verdict(key + " few", [args[0], "tiled-few", *args[2:]])
            qmm_cuda.TILED_FEW = few is None
            _qmm["tiled_few"] = few or "ok"  # 2..16 rows through it too
            return
        log.warning("tiled 4-bit matmul kernel not used: %s", tiled)
    key = f"mlx {mx.__version__} qmm wide {digest}"
    result = _child_verdict(key, ["sanctum.engine.kernels.qmm_checks", "wide"])
    _qmm["wide"] = result or "ok"
    qmm_cuda.WIDE = result is None
    if result is not None:
        log.warning("wide 4-bit matmul kernel not used: %s", result)


_draft = {"verdict": "not checked", "attention_layers": 0, "conv_layers": 0}


def prepare_drafter(body, block_rows: tuple[int, ...] = (8, 16)) -> None:
    """At load, on CUDA: route a bfloat16 draft body's block attention and DFlash 2
    convolutions through draft_cuda.py's kernels once their check on this body's shapes agreed
    with the MLX path on this GPU; SANCTUM_DRAFT_KERNELS=off keeps MLX's ops."""
    if not is_cuda() or body is None:
        return
    if settings.device().draft_kernels == "off":
        _draft["verdict"] = "off (SANCTUM_DRAFT_KERNELS=off)"
        return
    if body.fc.weight.dtype != mx.bfloat16:
        _draft["verdict"] = f"not used: the body is {body.fc.weight.dtype}"
        return
    specs, convs = [], []
    for layer in body.layers:
        spec = layer.self_attn.kernel_spec()
        if spec is not None and all(draft_cuda.attention_supported(spec, r) for r in block_rows):
            specs.append(spec)
        if "attention_conv" in layer:
            conv = layer.attention_conv
            convs.append([body.cfg.hidden_size, conv.kernel, conv.group])
    specs_args = [dict(s.__dict__) for s in dict.fromkeys(specs)]
    conv_args = [list(c) for c in dict.fromkeys(tuple(c) for c in convs)]
    args = json.dumps({"specs": specs_args, "convs": conv_args, "rows": list(block_rows)})
    source = (draft_cuda.HEADER + draft_cuda.ATTENTION_SOURCE + draft_cuda.CONV_SOURCE).encode()
    key = f"mlx {mx.__version__} draft {hashlib.sha1(source).hexdigest()[:12]} {args}"
    result = _child_verdict(key, ["sanctum.engine.kernels.draft_cuda", args])
    if not isinstance(result, dict):  # the child failed: its message
        result = {"attention": result, "conv": result}
    attention_ok = bool(specs) and result.get("attention") is None
    conv_ok = bool(convs) and result.get("conv") is None
    body.use_kernels(attention=attention_ok, conv=conv_ok)
    _draft["verdict"] = {k: v or "ok" for k, v in result.items()}
    _draft["attention_layers"] = len(specs) if attention_ok else 0
    _draft["conv_layers"] = len(convs) if conv_ok else 0
    for name, why in result.items():
        if why is not None:
            log.error("draft %s kernel DISAGREES with the MLX path, not used: %s", name, why)
            print(f"sanctum: draft {name} kernel disabled: {why}", file=sys.stderr)


def verify_width(width: int, blocks: int = 1) -> int:
    """Rows a verify block of `width` is padded to (at its end: the target is causal) when
    `blocks` blocks go through one forward: on CUDA enough for MATRIX_ROWS rows in all. Below
    that MLX's 4-bit matmul runs one one-row kernel per row (docs/performance.md), and a solo
    verify of a narrow block would round differently from the same block in a batch, which
    reaches the matrix kernel."""
    if not is_cuda():
        return width
    return max(width, -(-MATRIX_ROWS // blocks))


def attention_mask(h: mx.array, cache) -> mx.array | str | None:
    """mlx-lm's attention mask for rows `h` [B, S, H] on top of an attention layer's `cache`;
    on CUDA a multi-row pass's "causal" as a boolean array made on the host, once a forward:
    given "causal", MLX CUDA's attention fallback builds the mask in every attention layer
    (two aranges and a comparison: three kernels a layer of a verify, bound by its launches).
    The same mask either way (row i sees the keys up to the cache's offset + i)."""
    mask = create_attention_mask(h, cache)
    if not (isinstance(mask, str) and mask == "causal" and is_cuda()):
        return mask
    rows, offset = h.shape[1], cache.offset
    return mx.array(np.arange(offset, offset + rows)[:, None] >= np.arange(offset + rows)[None])


def pad_rows(x: mx.array, multiple: int = 8) -> mx.array:
    """[R, H] -> [R', H], R' the next multiple of `multiple`, zero rows added, on CUDA only:
    MLX CUDA's 4-bit matmul runs one one-row kernel per row below 8 rows and a matrix kernel
    from 8 rows on (docs/performance.md). The caller slices the result back to R rows."""
    pad = (-x.shape[0]) % multiple
    if pad == 0 or not is_cuda():
        return x
    return mx.concatenate([x, mx.zeros((pad, *x.shape[1:]), x.dtype)])


def report() -> dict:
    """The decisions in force, for benchmark output."""
    return {
        "device": str(mx.default_device()),
        "device_path": platform.current().path,
        "cuda": is_cuda(),
        "cudnn_sdpa": dict(settings.device().cudnn_sdpa),
        "q8_attention": "dequantized" if q8_dequantized() else "quantized",
        "gdn_block_kernel": _gdn["in_use"],
        "gdn_block_kernel_in_compile": _gdn["in_compile"],
        "shared_rollback": settings.device().shared_rollback,
        "gdn_kernel_checks": {str(k[:4]) + f" {k[4]}": v or "ok" for k, v in _checked.items()},
        "few_row_qmm_kernel": dict(_qmm),
        "draft_kernels": dict(_draft),
        "kernel_builds": dict(build.STATS, mode=settings.device().cuda_builds),
    }
