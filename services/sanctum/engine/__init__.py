"""The engine, the ground floor: pure MLX. The target driven layer by layer (taps, one-pass
verify, rollback, rung-split prefill), the DFlash / DFlash 2 drafters, the speculative round,
sampling. It imports nothing of sanctum outside engine/, and neither Ray, gRPC nor protobuf."""
