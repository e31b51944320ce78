"""Training on each rank: the entry point (run.py), the Trainer callbacks that feed the run
directory, asynchronous snapshots and the parallel strategy (DDP or DeepSpeed ZeRO)."""
