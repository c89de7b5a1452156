"""`sanctum bench ...`: the benchmarks, one module per family, on top of every layer."""
