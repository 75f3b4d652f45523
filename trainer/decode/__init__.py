"""Decoding over static KV caches: shapes never change, so a decode step and a whole speculative round can each be
captured once as a CUDA graph (main thread, at setup) and replayed; `generate.py` runs batches of prompts the same
way. `reference.py` keeps the HF DynamicCache reference implementation that these are tested against; `rounds.py`
what a round commits and how rounds are counted; `decoders.py` picks an engine."""
