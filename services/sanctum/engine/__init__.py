"""The engine, the ground floor: pure MLX, in one process. It imports nothing of sanctum outside
engine/ but the settings, and neither Ray, gRPC nor protobuf. Three rooms, imports pointing one
way (decode -> model -> kernels):

- `decode/`: the decode loop and its policies: a request's `Sequence`, the `Decoder` and its
  round (draft, verify, accept, roll back), the speculation gate, lookup of repeated text,
  adaptive width, drafting ahead, sampling and acceptance, shared rounds of several sequences,
  the drafter reached through a `DraftPeer`.
- `model/`: the model pieces: the target driven layer by layer (taps, one-pass verify, rollback
  tapes, prefill), attention and Gated DeltaNet layers, the DFlash / DFlash 2 drafter.
- `kernels/`: what depends on the device: the one decision of the device path (platform.py),
  the CPU's JIT and exact fast ops, fused projections, CUDA kernels and their checks.
"""
