"""Remote kernels: "Python (Workbench)" on an SSH target or in a Slurm allocation, from the launcher.

- :mod:`workbench.kernels.specs`: ``workbench kernels install|list|remove`` (a kernelspec per target);
- :mod:`workbench.kernels.provisioner`: the jupyter_client provisioner those kernelspecs name;
- :mod:`workbench.kernels.placement`: starting, watching and stopping the kernel on the target;
- :mod:`workbench.kernels.tunnel`: the kernel's ports forwarded over SSH;
- :mod:`workbench.kernels.ledger`: the priced record of each kernel session;
- :mod:`workbench.kernels.remote_kernel`: what runs on the target.

See docs/kernels.md.
"""
