"""The one thread that owns MLX in a serving process: MLX streams belong to the thread that
created them, so the thread that loads the models is the one that runs them. It runs `load()`,
then `serve(loaded)` for good; other threads only hand it work (the scheduler's queue, the
drafter's socket) and wait for the load with `wait_ready`. As in mlx-lm's server.

Once loaded, the process's objects are frozen out of Python's garbage collector (`gc.freeze`,
after one collection of the load's own garbage): they live as long as the process, and every
full collection walked all of them, a pause of most of a shared round on a small CPU, in
whichever round it fell (docs/performance.md).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class MlxThread(Generic[T]):
    def __init__(self, load: Callable[[], T], serve: Callable[[T], None], name: str, what: str):
        self.what = what  # what it loads, for errors: "the models", "the drafter"
        self.loaded: T | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(load, serve), name=name, daemon=True)
        self.thread.start()

    def _run(self, load: Callable[[], T], serve: Callable[[T], None]) -> None:
        try:
            self.loaded = load()
        except BaseException as exc:
            self.error = exc
            self._ready.set()
            return
        gc.collect()
        gc.freeze()
        self._ready.set()
        serve(self.loaded)

    @property
    def serving(self) -> bool:
        """Loaded, and running `serve`."""
        return self._ready.is_set() and self.error is None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until `load` has returned; raises if it failed (or took longer than `timeout`)."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.what} did not load in time")
        if self.error is not None:
            raise RuntimeError(f"loading {self.what} failed: {self.error}") from self.error
