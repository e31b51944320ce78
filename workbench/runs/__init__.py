"""A run's life, from launch to its last word: the one launch path (:mod:`.launching`), the run
directory every reader goes through (:mod:`.rundir`), the registry of runs (:mod:`.registry`),
the Job handle (:mod:`.jobs`) and its attempts (:mod:`.attempts`), the processes that run it on
a node (:mod:`.standby`, :mod:`.supervise` with :mod:`.node` and :mod:`.failure`,
:mod:`.launcher`, :mod:`.procs`), what it costs (:mod:`.budget`, :mod:`.startup`) and who pays
it (:mod:`.ledger`, :mod:`.wallet`), its snapshots (:mod:`.snapshots`), reproduce.zip
(:mod:`.reproduce`) and WORKBENCH_HOME (:mod:`.home`).

Nothing is re-exported here: import the module that owns the name.
"""
