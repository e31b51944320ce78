"""Remote kernels: "Python (Workbench)" on an SSH target or in a Slurm allocation, from the launcher.

- :mod:`workbench.targets.kernels.specs`: ``workbench kernels install|list|remove`` (a kernelspec per target);
- :mod:`workbench.targets.kernels.provisioner`: the jupyter_client provisioner those kernelspecs name;
- :mod:`workbench.targets.kernels.placement`: starting, watching and stopping the kernel on the target;
- :mod:`workbench.targets.kernels.tunnel`: the kernel's ports forwarded over SSH;
- :mod:`workbench.targets.kernels.heartbeat`: the client's heartbeat, and the kernel ending itself without it;
- :mod:`workbench.targets.kernels.ledger`: the priced record of each kernel session, settled from what the
  target saw (:mod:`workbench.targets.kernels.observe`) once its client is gone;
- :mod:`workbench.targets.kernels.remote_kernel`: what runs on the target.

See docs/kernels.md.
"""
