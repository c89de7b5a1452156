"""MLX's CPU JIT, given the host's vector instructions.

Why: on the CPU, MLX compiles each fused elementwise kernel of a compiled graph at run time with
`g++ -std=c++17 -O3` and no target ISA. On x86-64 every such kernel then runs one element at a
time, and MLX's exp (sigmoid, SiLU and softmax all use it) calls libm's `fmaf` at each step of its
polynomial: in a perf profile of the default pair on 4 prompts at a 2K-token context (prefill
and speculative decoding) on this project's CI-sized machine, exp and fmaf took ~40% of the MLX
thread, as much as the matrix products.

MLX runs `g++` from PATH. `prepare` puts a wrapper first on PATH that adds FLAGS:
`-march=native` (the host's vector ISA) and `-ffp-contract=off` (no a*b+c contracted into one
fused multiply-add, which would round once instead of twice); and, so that a kernel's loop
vectorizes at all, `-finline-limit=100000` (MLX's exp is a function GCC would not inline),
`-fno-math-errno` (floor and fma as instructions, not calls that may set errno) and
`-fno-trapping-math` (its selects as blends: GCC reported "control flow in loop" without it).
None of them changes a result: the kernels compute the same bits as MLX's precompiled ops
(tests/engine/test_cpu.py compares them). With only the first two, GCC left every loop scalar
(timings: docs/performance.md).

MLX keeps each compiled library under `<temp dir>/mlx/<version>/cpu/` by kernel name and reuses
it, so kernels compiled before the wrapper, or with other flags, would stay as they were: the
first `prepare` on a machine with these FLAGS removes them (a marker file naming the flags,
under a lock). `SANCTUM_CPU_JIT=off` leaves MLX's command as it is (and takes an inherited
wrapper off PATH). Nothing changes on a GPU, or where no g++ is found, or where the flags fail
a test compile.

`shifted_exp`, `softmax` and `logsumexp` at the end are the forms of MLX's exp, softmax and
logsumexp that the hot paths call (the grouped attention, sampling's probabilities, the greedy
rule): compiled on the CPU, MLX's own ops elsewhere.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from functools import partial
from pathlib import Path

import mlx.core as mx

from ... import settings
from . import platform

FLAGS = (
    "-march=native",
    "-ffp-contract=off",
    "-finline-limit=100000",
    "-fno-math-errno",
    "-fno-trapping-math",
)
_MARKER = ".sanctum-native-jit"
_WRAPPER_PREFIX = "sanctum-jit-"
_on: bool | None = None  # decided by the first prepare


def jit_cache_dir() -> Path:
    """Where MLX keeps its compiled CPU kernels (it follows the temp dir at each compile)."""
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def _wrapper_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"{_WRAPPER_PREFIX}{os.getuid()}"


def _write_wrapper(compiler: str) -> tuple[Path, bool]:
    """A `g++` that runs `compiler` with FLAGS before MLX's own arguments (written atomically:
    several processes may start at once); and whether it was there already, as it is."""
    folder = _wrapper_dir()
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / "g++"
    text = f'#!/bin/sh\nexec "{compiler}" {" ".join(FLAGS)} "$@"\n'
    if path.exists() and path.read_text() == text:
        return path, True
    tmp = folder / f".g++.{os.getpid()}"
    tmp.write_text(text)
    tmp.chmod(0o700)
    os.replace(tmp, path)
    return path, False


def _compiles(wrapper: Path) -> bool:
    """Whether the wrapper builds a shared library here (a noexec temp dir, a compiler that
    rejects the flags: then MLX keeps its own command)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text('extern "C" float probe(float x) { return x * 2.0f + 1.0f; }\n')
        try:
            run = subprocess.run(
                [
                    str(wrapper),
                    "-std=c++17",
                    "-O3",
                    "-fPIC",
                    "-shared",
                    str(src),
                    "-o",
                    str(Path(tmp) / "probe.so"),
                ],
                capture_output=True,
                timeout=60,
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return run.returncode == 0


def _stamp() -> str:
    return " ".join(FLAGS) + "\n"


def _drop_stale_kernels(cache: Path) -> None:
    """Remove the kernels MLX compiled before the wrapper or with other FLAGS (once a machine
    and set of flags, under a lock)."""
    cache.mkdir(parents=True, exist_ok=True)
    marker = cache / _MARKER
    if _marked(marker):
        return
    with open(cache / f"{_MARKER}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _marked(marker):  # another process did it while this one waited
            return
        for lib in cache.glob("lib*.so"):
            lib.unlink(missing_ok=True)
        marker.write_text(_stamp())


def _marked(marker: Path) -> bool:
    return marker.exists() and marker.read_text() == _stamp()


def _without_wrappers(path: str) -> str:
    """PATH without any folder of a wrapper (a parent process's, inherited)."""
    parts = path.split(os.pathsep)
    return os.pathsep.join(p for p in parts if not Path(p).name.startswith(_WRAPPER_PREFIX))


def prepare() -> bool:
    """Install the wrapper for this process (idempotent); returns whether it is in use."""
    global _on
    if _on is not None:
        return _on
    device = settings.device()
    # MLX runs the g++ it finds on PATH: the wrapper goes there (a parent's is taken off first)
    path = _without_wrappers(device.search_path)
    os.environ["PATH"] = path
    _on = False
    if device.cpu_jit == "off" or not platform.current().is_cpu:
        return _on
    compiler = shutil.which("g++", path=path)
    if compiler is None:
        return _on
    wrapper, kept = _write_wrapper(compiler)
    cache = jit_cache_dir()
    # the probe compile once: a kept wrapper and the marker say it passed
    if (kept and _marked(cache / _MARKER)) or _compiles(wrapper):
        _drop_stale_kernels(cache)
        os.environ["PATH"] = str(wrapper.parent) + os.pathsep + path
        _on = True
    return _on


@partial(mx.compile, shapeless=True)  # one trace for every shape
def shifted_exp(x: mx.array, peak: mx.array) -> mx.array:
    """exp(x - peak) as a compiled kernel: the same bits as MLX's exp op, vectorized on the CPU
    by the JIT above (MLX's own CPU exp runs one element at a time)."""
    return mx.exp(x - peak)


@partial(mx.compile, shapeless=True)
def _normalized(e: mx.array, total: mx.array) -> mx.array:
    return e * (1 / total)  # as MLX's softmax: one reciprocal a row, then products


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis (float32 in, float32 out), as MLX's precise softmax computes
    it. On the CPU the exp runs in a compiled, vectorized kernel (faster than `mx.softmax`:
    docs/performance.md); elsewhere MLX's own op."""
    if not platform.current().is_cpu:
        return mx.softmax(x, axis=-1)
    e = shifted_exp(x, x.max(-1, keepdims=True))
    return _normalized(e, e.sum(-1, keepdims=True))


def logsumexp(x: mx.array) -> mx.array:
    """`mx.logsumexp(x, axis=-1, keepdims=True)` to the bit, faster on the CPU.

    MLX's CPU kernel takes each row's max, then sums exp(x - max) in float32 one element at a
    time, in order, with its scalar exp, which dominates a verify's greedy picks. The
    same sum here: the exp as a compiled kernel (the same bits, vectorized: `shifted_exp`),
    added in order as the last prefix sum of MLX's scan (tests/engine/test_sampling.py compares both
    to the bit). On a GPU MLX's kernel sums in another order, so it runs there."""
    if not platform.current().is_cpu:
        return mx.logsumexp(x, axis=-1, keepdims=True)
    wide = x.astype(mx.float32)
    peak = wide.max(axis=-1, keepdims=True)
    total = mx.cumsum(shifted_exp(wide, peak), axis=-1)[..., -1:]
    return mx.where(mx.isinf(peak), peak, mx.log(total) + peak).astype(x.dtype)
