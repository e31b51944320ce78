"""Where an endpoint's server runs: the serve targets, under the name they had before the package.

They live in :mod:`workbench.serve` now (:mod:`~workbench.serve.target` for the protocol,
:mod:`~workbench.serve.local`, :mod:`~workbench.serve.ssh` and :mod:`~workbench.serve.slurm` for
the targets, :mod:`~workbench.serve.targets` for :func:`get_serve_target`); this module keeps
``from workbench.serve_targets import ...`` in notebooks and scripts working.
"""

from workbench.serve.local import LocalServeTarget
from workbench.serve.remote import close_tunnel, open_tunnel
from workbench.serve.server import GUARD, guard_command
from workbench.serve.slurm import SlurmServeTarget, serve_sbatch_script
from workbench.serve.ssh import SSHServeTarget
from workbench.serve.target import ANY_ADDRESS, PROBE, ServeTarget, read_address
from workbench.serve.targets import get_serve_target

__all__ = ["ANY_ADDRESS", "GUARD", "PROBE", "LocalServeTarget", "SSHServeTarget", "ServeTarget",
           "SlurmServeTarget", "close_tunnel", "get_serve_target", "guard_command", "open_tunnel",
           "read_address", "serve_sbatch_script"]
