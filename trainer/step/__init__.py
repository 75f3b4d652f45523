"""The training step (eager here; compile/graph modes on the GPU branch)."""
