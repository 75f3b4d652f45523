"""The static decode layers, one per kind of mixer or MLP (`stack.py` assembles them per layer)."""
