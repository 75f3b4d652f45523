"""Models: the frozen target (HF), the drafter (pure torch), block attention and the chunked loss."""
