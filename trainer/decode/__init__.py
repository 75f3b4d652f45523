"""Batch-1 decoding over static KV caches: shapes never change, so a decode step and a whole speculative round can
each be captured once as a CUDA graph (main thread, at setup) and replayed. `reference.py` keeps the HF
DynamicCache reference implementation that these are tested against; `rounds.py` what a round commits and how
rounds are counted; `decoders.py` picks an engine."""
