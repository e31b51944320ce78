"""Where runs go: named targets (:mod:`.named`, WORKBENCH_HOME/targets.yaml), checking one before
anything runs there (:mod:`.check`), setting its Python environment up (:mod:`.setup`, with
:mod:`.wheels`), model folders that live on a target (:mod:`.remote_model`), the GPU table
(:mod:`.gpus`), GPU leases on this machine (:mod:`.leases`) and the backends that start a run
directory on a target (:mod:`.backends`: local, SSH, Slurm); what looks secret and stays out of
what travels to a target (:mod:`.secrets`); a notebook's kernel on a target (:mod:`.kernels`).

Nothing is re-exported here: import the module that owns the name.
"""
