"""`python -m trainer regenerate`: answer a prompt set with the target itself, into training JSONL (run.py)."""
