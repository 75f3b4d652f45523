"""Batch-1 decoding over static KV caches: shapes never change, so a decode step and a whole speculative round can
each be captured once as a CUDA graph (main thread, at setup) and replayed. `trainer.speculative` keeps the HF
DynamicCache reference implementation that these are tested against."""
