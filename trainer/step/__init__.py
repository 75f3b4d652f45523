"""The training step: step.py (forward/backward, optimizer step), slots.py (the flat step encoding), policy.py (what
compiles, the FP8 head, the CE kernel), stepper.py (the eager or captured `Stepper`, built by `build_stepper`),
graph.py (the captured step, StepGraph)."""
