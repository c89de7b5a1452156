"""Which path this process's device takes: "cpu", "cuda" or "metal", decided once from the MLX
device and the settings (SANCTUM_DEVICE_PATH), and read by every device-dependent choice in the
engine. A test can force a path (`forced`): with "metal" on a CPU machine the Metal-only
branches run, each Metal kernel replaced by its ops form (`Platform.metal_kernels` is False).

What each path decides:
- cpu: MLX's CPU JIT with the host's ISA (cpu.py), the grouped attention and compiled softmax
  (sdpa.py, cpu.py), the chunked GDN form with LAPACK's inverse, float32 weights at load.
- cuda: the checked CUDA kernels and switches (cuda.py), verify blocks padded to the matrix
  kernel's rows; a forward hands its layers on to the device as it builds them.
- metal: mlx-lm's Metal GDN kernel for every shape, so a rollback re-runs the recurrence over
  the kept rows; a forward hands its layers on to the device as it builds them.
A GPU path (cuda, metal) also drafts the next block ahead by default (decode/policy.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx

from ... import settings

PATHS = ("cpu", "cuda", "metal")


@dataclass(frozen=True)
class Platform:
    path: str  # one of PATHS

    @property
    def is_cpu(self) -> bool:
        return self.path == "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.path == "cuda"

    @property
    def is_metal(self) -> bool:
        return self.path == "metal"

    @property
    def is_gpu(self) -> bool:
        """A device that computes while the host builds the next graph (async_eval pays)."""
        return self.path != "cpu"

    @property
    def metal_kernels(self) -> bool:
        """Metal kernels can run here: the metal path with MLX on an Apple GPU (mlx-lm's own
        rule). Elsewhere, the CPU of a Mac included, their ops forms stand in."""
        return self.is_metal and mx.default_device() == mx.gpu and mx.metal.is_available()


def _cuda_available() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def detect() -> str:
    """The path of MLX's default device."""
    if mx.default_device() != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda" if _cuda_available() else "cpu"


_decided: dict[bool, Platform] = {}  # on the GPU (MLX's default device) -> its platform
_forced: Platform | None = None


def current() -> Platform:
    """The platform in force: a forced one, else the one decided for MLX's default device."""
    if _forced is not None:
        return _forced
    on_gpu = mx.default_device() == mx.gpu
    found = _decided.get(on_gpu)
    if found is None:
        setting = settings.device().path
        found = _decided[on_gpu] = Platform(detect() if setting == "auto" else setting)
    return found


@contextmanager
def forced(path: str) -> Iterator[Platform]:
    """Inside the block every decision takes `path` (tests)."""
    global _forced
    if path not in PATHS:
        raise ValueError(f"device path must be one of {PATHS}, got {path!r}")
    before, _forced = _forced, Platform(path)
    try:
        yield _forced
    finally:
        _forced = before
