"""The model pieces: the target (an mlx-lm model driven layer by layer), its attention and Gated
DeltaNet layers with their rollback tapes, checkpoints on disk, and the DFlash drafter. Knows the
device kernels (kernels/) and nothing of the decode loop."""
