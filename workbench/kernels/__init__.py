"""Remote kernels: "Python (Workbench)" on an SSH target or in a Slurm allocation, from the launcher.

- :mod:`workbench.kernels.specs`: ``workbench kernels install|list|remove`` (a kernelspec per target);
- :mod:`workbench.kernels.provisioner`: the jupyter_client provisioner those kernelspecs name;
- :mod:`workbench.kernels.placement`: starting, watching and stopping the kernel on the target;
- :mod:`workbench.kernels.tunnel`: the kernel's ports forwarded over SSH;
- :mod:`workbench.kernels.heartbeat`: the client's heartbeat, and the kernel ending itself without it;
- :mod:`workbench.kernels.ledger`: the priced record of each kernel session, settled from what the
  target saw (:mod:`workbench.kernels.observe`) once its client is gone;
- :mod:`workbench.kernels.remote_kernel`: what runs on the target.

See docs/kernels.md.
"""
