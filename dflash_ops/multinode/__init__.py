"""Multi-node runs: one run of torchrun on several nodes (`launch --node`), found, read and stopped as one.

rendezvous.py (pure: the torchrun wiring and its checks), state.py (pure: the run's state from its nodes'),
recordfile.py (the records on this machine), fan.py (every node at once), plan.py (the nodes and every node's
command, before anything connects), launch.py (all or none), watch.py (where a run lives, its nodes' states and
status rows, stop). The run's record and node names are a value below this package: dflash_ops/noderecord.py.
Nothing is imported here.
"""
