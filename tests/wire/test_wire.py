"""Tensors between processes (wire/tensors.py): MLX arrays through numpy keep their bits, and a
prompt-cache entry's one layout (cache/layout.py) carries it to the store actor's service and
back."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from sanctum.wire.gen import roles_pb2 as roles
from sanctum.wire.tensors import dtype_name, from_numpy, to_numpy


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_numpy_roundtrip_keeps_bits(dtype):
    a = (mx.random.normal((3, 5)) * 100).astype(dtype)
    b = from_numpy(to_numpy(a), dtype_name(a.dtype))
    assert b.dtype == dtype and mx.array_equal(a, b).item()


def test_store_layout_and_service_roundtrip(tmp_path):
    from sanctum.cache.store import CacheEntry, PromptStore
    from sanctum.cluster.store import StoreService
    from sanctum.wire.tensors import flatten, unflatten

    T = 10
    kv = [
        (mx.random.normal((1, 2, T, 64)), mx.random.normal((1, 2, T, 64))),
        (mx.zeros((1, 2, T, 16), mx.uint32), mx.ones((1, 2, T, 1), mx.bfloat16),
         mx.ones((1, 2, T, 1), mx.bfloat16), mx.zeros((1, 2, T, 16), mx.uint32),
         mx.ones((1, 2, T, 1), mx.bfloat16), mx.ones((1, 2, T, 1), mx.bfloat16)),
    ]  # fmt: skip
    rung = lambda: [
        (mx.random.normal((1, 3, 32)).astype(mx.bfloat16), mx.random.normal((1, 4, 8, 8)))
    ]
    rungs = {5: rung(), 10: rung()}
    taps = mx.random.normal((T, 24))
    layout, arrays = flatten(kv, rungs, taps)
    kv2, rungs2, taps2 = unflatten(layout, [np.array(to_numpy(a)) for a in arrays])
    flat = lambda k, r, t: (
        [a for layer in k for a in layer] + [x for p in sorted(r) for s in r[p] for x in s] + [t]
    )
    assert all(mx.array_equal(a, b).item() and a.dtype == b.dtype for a, b in
               zip(flat(kv, rungs, taps), flat(kv2, rungs2, taps2)))  # fmt: skip

    store = PromptStore(1 << 30, tmp_path)
    service = StoreService(store)
    tokens = np.arange(1, T + 1, dtype=np.int32)
    entry = CacheEntry("m|fp16", "fp16", tokens, kv[:1], rungs, taps)
    header = roles.EntryHeader(model_key=entry.model_key, kv_mode="fp16", tokens=tokens.tolist(),
                               layout=flatten(entry.kv, entry.rungs, entry.taps)[0])  # fmt: skip
    assert service.put(
        header.SerializeToString(), [np.array(to_numpy(a)) for a in flatten(kv[:1], rungs, taps)[1]]
    )
    query = roles.PlanQuery(model_key="m|fp16", prompt_ids=[*tokens[:8].tolist(), 99])
    raw_header, raw = service.plan(query.SerializeToString())
    h = roles.ResumePlanHeader.FromString(raw_header)
    assert (h.requested_lcp, h.resumed_at) == (8, 5)
    kv3, rungs3, taps3 = unflatten(h.layout, raw)
    assert kv3[0][0].shape[-2] == 5 and sorted(rungs3) == [5] and taps3.shape[0] == 5
    assert mx.array_equal(kv3[0][0], kv[0][0][..., :5, :]).item()
    assert len(PromptStore(1 << 30, tmp_path)) == 1  # persisted: a restarted store reloads it
