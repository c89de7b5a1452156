"""What depends on the device: which path it takes (platform.py), the CPU's JIT and exact fast
ops, fused sibling projections, attention over a few rows, and CUDA kernels with their checks
against the MLX math. Imports nothing of the model: a kernel's check gets its reference passed in
or keeps it here (draft_reference.py)."""
