"""Training on MLX: the tokenizer, a small hybrid target (Gated DeltaNet + attention, 3:1), and a
DFlash drafter for any mlx-lm target (frozen target, online taps, random anchors, block masks).

Runs wherever MLX runs: the CPU for smoke tests, CUDA or an Apple GPU for real runs. Writes
checkpoints in the Hugging Face layout that `engine.model.target.load_target` and
`engine.model.drafter.load_drafter` read; knows nothing about Ray, gRPC or the decode loop.
"""
