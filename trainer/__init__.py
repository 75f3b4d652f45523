"""trainer: the DFlash block-diffusion drafter trainer, its decoders and the quality pipeline.

docs/architecture.md draws how its modules fit together and names every one (tests/test_architecture_doc.py keeps
it so). Benchmarks live outside the package, in the repository's bench/.
"""
