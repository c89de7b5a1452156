"""The drafter's context caches and the masks of a block over them."""

from __future__ import annotations

import mlx.core as mx

from ...kernels.draft_reference import block_attention_mask


class ContextCache:
    """One drafter layer's context keys/values ([B, n_kv, C, d]), appended a few rows a round.

    A sliding layer keeps only the last `window` rows (sliding_window - 1: all that its anchor
    row can see). mlx-lm's RotatingKVCache would hold them in rotated order after one-row
    updates, while the per-row window mask needs time order, so this keeps its own buffer:
    written in place, `STEP` rows of headroom, compacted when the headroom is used up. A sliding
    layer's buffer also keeps `window` rows in front of its own (zeros, or rows that slid out),
    so a context padded to any bucket is a view of the buffer, not a new array (`padded`)."""

    STEP = 256

    def __init__(self, window: int | None = None):
        self.window = window
        self.keys: mx.array | None = None  # [B, n_kv, capacity, d]
        self.values: mx.array | None = None
        self.begin = self.end = 0  # the rows in use: keys[..., begin:end, :]
        # rows written after `end` whose count the device knows and the host not yet (a block
        # drafted before its round's acceptance is read: `append_unsettled`)
        self.unsettled: mx.array | None = None

    def append(self, keys: mx.array, values: mx.array) -> None:
        self._write(keys, values, keys.shape[2])
        self._advance(keys.shape[2])

    def append_unsettled(self, keys: mx.array, values: mx.array, count: mx.array) -> None:
        """Write n rows after `end` of which only the first `count` (an int32 array, not yet
        evaluated) are context: `bounds` counts them, and `settle` once the host knows the
        count. The rows after them are overwritten by the next append."""
        assert self.unsettled is None, "settle the rows appended before"
        self._write(keys, values, 1)
        self.unsettled = count

    def settle(self, count: int) -> None:
        """The host learns how many rows of the unsettled append are context."""
        self.unsettled = None
        self._advance(count)

    def _write(self, keys: mx.array, values: mx.array, used: int) -> None:
        """Write the n rows after `end`, the buffer regrown first if they do not fit; at least
        `used` of them will be in use (the rows that then slide out are not kept)."""
        n = keys.shape[2]
        if self.keys is None or self.end + n > self.keys.shape[2]:
            held = self.end - self.begin
            if self.window is not None:
                held = min(held, max(0, self.window - used))
            B, H, _, D = keys.shape
            front = self.window or 0
            capacity = front + held + n + self.STEP
            new_k = mx.zeros((B, H, capacity, D), keys.dtype)
            new_v = mx.zeros((B, H, capacity, values.shape[-1]), values.dtype)
            if held:
                kept = slice(self.end - held, self.end)
                new_k[..., front : front + held, :] = self.keys[..., kept, :]
                new_v[..., front : front + held, :] = self.values[..., kept, :]
            self.keys, self.values, self.begin, self.end = new_k, new_v, front, front + held
        self.keys[..., self.end : self.end + n, :] = keys
        self.values[..., self.end : self.end + n, :] = values

    def _advance(self, n: int) -> None:
        self.end += n
        if self.window is not None:
            self.begin = max(self.begin, self.end - self.window)

    def fetch(self) -> tuple[mx.array, mx.array]:
        assert self.unsettled is None, "rows in use unknown on the host: read by `bounds`"
        return (
            self.keys[..., self.begin : self.end, :],
            self.values[..., self.begin : self.end, :],
        )

    @property
    def num_rows(self) -> int:
        return self.end - self.begin

    def block_mask(self, num_rows: int, causal: bool, window: int | None) -> mx.array | None:
        """The mask of a block of `num_rows` rows over these context rows and its own."""
        return block_attention_mask(self.num_rows, num_rows, causal, window)

    def padded(self, rows: int, block_rows: int, causal: bool, window: int | None, masks: dict):
        """The context as `rows` rows (the real ones last, the pad rows in front masked out) and
        the block's mask over them: one shape for every round while the rows fit `rows`. The pad
        rows are the buffer's own rows in front of `begin` (a sliding layer's buffer keeps
        `window` of them: zeros, or rows that slid out; finite, and never seen), so the padded
        context is a view, no new array. `masks`: a dict that keeps masks by shape and pad, for
        the layers and rounds that share them."""
        pad = rows - self.num_rows
        assert self.window is not None and 0 <= pad and rows <= self.end, (rows, self.end)
        keys = self.keys[..., self.end - rows : self.end, :]
        values = self.values[..., self.end - rows : self.end, :]
        key = (rows, block_rows, pad, causal, window)
        if (mask := masks.get(key)) is None:
            mask = masks[key] = padded_block_mask(*key)
        return FetchedContext(keys, values, mask)

    def bounds(self) -> mx.array:
        """int32 [begin, end, capacity]: what the CUDA attention kernel reads the buffer by
        (unevaluated while rows are unsettled)."""
        capacity = self.keys.shape[2]
        if self.unsettled is None:
            return mx.array([self.begin, self.end, capacity], mx.int32)
        end = self.end + self.unsettled
        begin = mx.array(self.begin, mx.int32)
        if self.window is not None:
            begin = mx.maximum(begin, end - self.window)
        return mx.stack([begin, end, mx.array(capacity, mx.int32)]).astype(mx.int32)

    def buffered(self) -> BufferContext:
        return BufferContext(self.keys, self.values, self.bounds())

    def bucket(self) -> int:
        """Rows `padded` pads a sliding layer's context to: the next multiple of STEP, at most
        the window (so a few shapes in all, and one once the window is full)."""
        return self.bucket_of(self.num_rows)

    def bucket_of(self, rows: int) -> int:
        """`bucket` once the context holds `rows` rows."""
        return min(self.window, self.STEP * max(1, -(-rows // self.STEP)))

    def rows_after(self, n: int) -> int:
        """The rows in use once `n` more are appended (a sliding layer keeps its window)."""
        rows = self.num_rows + n
        return rows if self.window is None else min(rows, self.window)

    def adopt(self, keys: mx.array, values: mx.array, rows: int) -> None:
        """Take `keys`/`values` ([1, n_kv, R, d], the rows in use last) as the buffer: what a
        shared round's stacked context hands back to each sequence (`decode.batch`)."""
        assert self.unsettled is None, "settle the rows appended before"
        self.keys, self.values = keys, values
        self.end = keys.shape[2]
        self.begin = self.end - rows

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class FetchedContext:
    """A context cache's rows as already fetched arrays, padded at the front to a bucket of rows,
    with the block's mask over them (what the compiled layer stack takes)."""

    def __init__(self, keys: mx.array, values: mx.array, mask: mx.array):
        self.keys, self.values, self.mask = keys, values, mask

    def fetch(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    @property
    def num_rows(self) -> int:
        return self.keys.shape[2]

    def block_mask(self, num_rows: int, causal: bool, window: int | None) -> mx.array:
        return self.mask


class BufferContext:
    """A context cache's whole buffer and the rows in use (`ContextCache.bounds`), as the CUDA
    attention kernel reads them: the same shapes every round until the buffer is regrown, so
    the compiled stack needs no padding and no mask."""

    def __init__(self, keys: mx.array, values: mx.array, bounds: mx.array):
        self.keys, self.values, self.bounds = keys, values, bounds


def padded_block_mask(
    rows: int, block_rows: int, pad: int, causal: bool, window: int | None
) -> mx.array:
    """[1, 1, L, rows + L]: `block_attention_mask` over `rows` context rows whose first `pad`
    are padding, never seen. A real key keeps its distance to every block row, so the window
    rule over `rows` rows holds for it as is."""
    mask = block_attention_mask(rows, block_rows, causal, window)
    if mask is None:
        mask = mx.ones((block_rows, rows + block_rows), mx.bool_)
    if pad > 0:
        mask = mask & (mx.arange(rows + block_rows) >= pad)
    return mask[None, None]  # stacks along the batch axis


def buffer_block_mask(
    bounds: mx.array, capacity: int, num_rows: int, causal: bool, window: int | None
) -> mx.array:
    """[1, 1, L, capacity + L]: `block_attention_mask` over a whole context buffer whose rows in
    use are bounds[0]..bounds[1] (int32, maybe not evaluated yet): the same keys visible, the
    buffer's other rows masked out. Buffer row j sits at position start - (end - j)."""
    rows = mx.arange(num_rows)[:, None]
    j = mx.arange(capacity)[None, :]
    end = bounds[1]
    ctx_ok = (j >= bounds[0]) & (j < end)
    if window is not None:
        ctx_ok = ctx_ok & (rows + end - j < window)
    own = mx.arange(num_rows)[None, :] <= rows if causal else mx.ones((num_rows,) * 2, mx.bool_)
    ctx_ok = mx.broadcast_to(ctx_ok, (num_rows, capacity))
    return mx.concatenate([ctx_ok, own], axis=1)[None, None]
