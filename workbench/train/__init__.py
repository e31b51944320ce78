"""Training on each rank: the entry point (run.py) with the model (model.py), the Trainer's
arguments (arguments.py) and its snapshotting Trainer class (snapshotting.py); the Trainer callbacks
that feed the run directory, asynchronous snapshots and the parallel strategy (DDP or DeepSpeed
ZeRO)."""
