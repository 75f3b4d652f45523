"""Prove the drafter: a small target made here (stdlib corpus), regenerated responses, a trained drafter, evaluation."""
