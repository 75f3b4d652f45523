"""Static decode layers, one per mixer kind and one MoE MLP (docs/architecture.md, "Decode layers per mixer and per
drafter"): each allocates its buffers once for R rows and computes the HF layer's arithmetic on its own weights."""
