"""Pieces of `python -m trainer.bench` (trainer/bench.py is the CLI): shapes and FLOPs (pure), synthetic batches
(pure, built with trainer.data's own packing and anchor sampling), clocks/timing, and one module per workload."""
