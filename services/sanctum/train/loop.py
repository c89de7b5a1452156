"""What the target and drafter trainers share: the learning-rate schedule, a step budget that
fits a wall-clock limit, the compiled AdamW step, sharded safetensors, the loss log and its plot.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from mlx import nn

SHARD_BYTES = 15_000_000  # each file stays under 16 MB (what one device call can bring back)


@dataclass
class Schedule:
    """Linear warmup, then cosine decay to `floor` * peak."""

    peak: float
    total: int
    warmup: int
    floor: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.peak * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class LossLog:
    """Rows of {step, seconds, loss, ...}, written as JSON beside the checkpoint."""

    rows: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def add(self, step: int, **values) -> dict:
        row = {"step": step, "seconds": round(time.perf_counter() - self.t0, 2)}
        row.update({k: round(float(v), 5) for k, v in values.items()})
        self.rows.append(row)
        return row

    def add_eval(self, step: int, **values) -> dict:
        row = {"step": step, **{k: round(float(v), 5) for k, v in values.items()}}
        self.evals.append(row)
        return row

    def save(self, path: Path, **extra) -> None:
        path.write_text(json.dumps({"train": self.rows, "eval": self.evals, **extra}, indent=1))


def make_step(model: nn.Module, loss_fn: Callable, optimizer: optim.Optimizer, clip: float,
              compile: bool = True) -> Callable:  # fmt: skip
    """One AdamW step on `model`'s trainable parameters: (batch...) -> (loss, metrics, grad_norm)."""
    grad_fn = nn.value_and_grad(model, loss_fn)

    def step(*batch):
        (loss, metrics), grads = grad_fn(*batch)
        grads, norm = optim.clip_grad_norm(grads, clip)
        optimizer.update(model, grads)
        return loss, metrics, norm

    if not compile:
        return step
    state = [model.state, optimizer.state, mx.random.state]
    compiled = [partial(mx.compile, inputs=state, outputs=state)(step)]

    def run(*batch):
        try:
            return compiled[0](*batch)
        except Exception as exc:
            if compiled[0] is step:
                raise
            print(f"mx.compile failed ({exc!r}); training uncompiled", file=sys.stderr)
            compiled[0] = step
            return step(*batch)

    return run


def fit_budget(
    step_seconds: float, done: int, planned: int, budget_s: float | None, elapsed: float
) -> int:
    """How many steps fit: all `planned`, or fewer when the wall-clock budget says so."""
    if not budget_s:
        return planned
    left = max(0.0, budget_s - elapsed)
    return max(done + 1, min(planned, done + int(left / max(step_seconds, 1e-6))))


# ---- checkpoints ------------------------------------------------------------------------


def save_sharded(
    out: Path, weights: dict[str, mx.array], max_bytes: int = SHARD_BYTES
) -> list[Path]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + an index when it is larger."""
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    shards, current, size = [], {}, 0
    for k in sorted(weights):
        nbytes = weights[k].nbytes
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[k] = weights[k]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in s}}  # fmt: skip
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    for name, shard in zip(names, shards):
        mx.save_safetensors(str(out / name), shard, metadata={"format": "pt"})
    return [out / n for n in names]


def cast_weights(weights: dict[str, mx.array], dtype: mx.Dtype, keep: tuple[str, ...] = ()) -> dict:
    """Floating weights to `dtype`, except names ending in one of `keep` (kept as they are)."""
    return {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith(keep) else v
        for k, v in weights.items()
    }


def parse_dtype(name: str) -> mx.Dtype:
    names = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
    if name not in names:
        raise ValueError(f"dtype must be one of {sorted(names)}, got {name!r}")
    return names[name]


# ---- the loss curve as a PNG ------------------------------------------------------------


def plot_losses(
    path: Path, panels: dict[str, dict[str, list[tuple[float, float]]]], title: str
) -> Path:
    """Loss curves as a PNG, one panel per run ({run: {curve: [(step, loss)]}}): matplotlib when
    installed (the `train` extra), else a plain raster drawn here."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_raster(
            path, {f"{r} {c}": p for r, cs in panels.items() for c, p in cs.items()}
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), dpi=100, squeeze=False)
    for ax, (run, curves) in zip(axes[0], panels.items()):
        for name, pts in curves.items():
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(run)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_raster(path: Path, curves: dict, width: int = 640, height: int = 360) -> Path:
    import numpy as np

    img = np.full((height, width, 3), 255, np.uint8)
    pts = [p for c in curves.values() for p in c]
    if pts:
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        x0, x1, y0, y1 = min(xs), max(xs) or 1, min(ys), max(ys)
        pad = 30
        img[height - pad, pad : width - pad] = 0
        img[pad : height - pad, pad] = 0
        colours = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
        for c, colour in zip(curves.values(), colours):
            for (ax, ay), (bx, by) in itertools.pairwise(c):
                for t in np.linspace(0, 1, 20):
                    x, y = ax + t * (bx - ax), ay + t * (by - ay)
                    px = int(pad + (x - x0) / max(x1 - x0, 1e-9) * (width - 2 * pad))
                    py = int(height - pad - (y - y0) / max(y1 - y0, 1e-9) * (height - 2 * pad))
                    img[max(0, py - 1) : py + 1, max(0, px - 1) : px + 1] = colour
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(height))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    head = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", head)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
    path.write_bytes(png)
    return path
