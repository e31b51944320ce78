"""The jupyter_client kernel provisioner that runs "Python (Workbench)" on an SSH target or in Slurm.

A kernelspec written by ``workbench kernels install`` names it (``metadata.kernel_provisioner``:
``provisioner_name: workbench-remote`` plus ``config``: target, gpus, time_limit, cull_idle_s,
wait_s), and the entry point ``jupyter_client.kernel_provisioners`` in pyproject.toml makes
Jupyter find it. For each start it:

1. checks the target (an unreachable host or a Python without ipykernel is refused with what to do);
2. starts the kernel there (:mod:`workbench.targets.kernels.placement`) with the KernelManager's key and
   ``WORKBENCH_TARGET`` set (``workbench.launch`` in the kernel then defaults to that target);
3. forwards its five ports to this machine's loopback (:mod:`workbench.targets.kernels.tunnel`); a Slurm
   target whose notebook runs on the login node connects to the node directly;
4. opens the session's bill (:mod:`workbench.targets.kernels.ledger`), rewritten at every poll;
5. beats the kernel's heartbeat (:mod:`workbench.targets.kernels.heartbeat`) until the kernel is released:
   a client that dies or exits without shutting the kernel down stops beating, and the kernel ends
   itself (on Slurm with its allocation); the bill is then settled from what the target saw.

Interrupt, terminate and kill signal the remote kernel by its recorded identity (Slurm: its job
step); shutdown and restart end the kernel, and on Slurm its allocation, which is cancelled and
confirmed gone before the next kernel asks for a new one. A dropped connection (the tunnel's SSH
process ended) marks the kernel dead and releases what it held. With ``cull_idle_s`` > 0 the
provisioner's own poll culls a kernel idle (no cell running) that long: it stops the server's
auto-restart for it, ends the kernel and releases its node, so an idle notebook does not hold GPUs
(jupyter-server's ``MappingKernelManager.cull_idle_timeout`` would cull every kernel alike).
Every remote look runs in a worker thread, or in the caller's thread once the interpreter is
shutting down (jupyter_client's atexit shutdown of ``jupyter run``), when no thread can start.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase
from traitlets import Float, Integer, Unicode

from workbench.errors import RemoteKernelError, TargetError
from workbench.targets.kernels.heartbeat import (
    MIN_ORPHAN_S,
    ORPHAN_AFTER_S,
    ORPHAN_ENV,
    Beater,
    beat_command,
)
from workbench.targets.kernels.ledger import Session, settle
from workbench.targets.kernels.placement import SlurmPlacement, SSHPlacement
from workbench.targets.kernels.tunnel import Tunnel

NAME = "workbench-remote"
POLL_EVERY_S = 1.0  # jupyter_client polls every 0.1 s while it waits: one remote look per second
# A kernel stops this many seconds' worth of money before its budget: the next poll, stopping the
# kernel and releasing its allocation (scancel, the tunnel) are still paid.
STOP_MARGIN_S = 15.0
T = TypeVar("T")


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread; in this thread once the interpreter is shutting down."""
    try:
        future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        return fn(*args)
    return await future


class WorkbenchProvisioner(KernelProvisionerBase):  # type: ignore[misc]
    """Start, watch, signal and stop a Workbench kernel on ``target`` (``ssh:NAME``/``slurm:NAME``)."""

    target = Unicode("", config=True, help="ssh:NAME or slurm:NAME from targets.yaml")
    gpus = Integer(0, config=True, help="GPUs of the Slurm allocation (and the price)")
    time_limit = Unicode("01:00:00", config=True, help="the Slurm allocation's --time")
    cpus = Integer(4, config=True, help="CPUs of the Slurm allocation")
    cull_idle_s = Float(0.0, config=True, help="end the kernel after this long idle; 0: never")
    wait_s = Float(300.0, config=True, help="how long a Slurm allocation may stay pending")
    budget_limit = Float(0.0, config=True, help="stop the kernel once its sessions cost this "
                                                  "much (the target's currency); 0: no limit")
    start_timeout_s = Float(180.0, config=True, help="how long the kernel may take to start")
    orphan_after_s = Float(ORPHAN_AFTER_S, config=True, help="end the kernel once its client "
                                                             "has not beaten for this long")

    placement: SSHPlacement | SlurmPlacement | None = None
    tunnel: Tunnel | None = None
    session: Session | None = None
    beater: Beater | None = None
    dead_reason: str | None = None  # why the kernel was lost or culled, once it was
    _polled: tuple[float, int | None] = (0.0, None)
    _loop: asyncio.AbstractEventLoop | None = None

    @property
    def has_process(self) -> bool:
        return self.placement is not None

    # -- start -----------------------------------------------------------------------------------
    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        km: Any = self.parent
        self.connection_info = {"transport": "tcp", "ip": "127.0.0.1", "key": km.session.key,
                                "signature_scheme": km.session.signature_scheme,
                                "kernel_name": getattr(km, "kernel_name", "")}
        kwargs.pop("extra_arguments", None)
        out: dict[str, Any] = await super().pre_launch(cmd=list(self.kernel_spec.argv), **kwargs)
        return out

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        env = kwargs.get("env") or {}
        remote_env = {"WORKBENCH_TARGET": self.target, "WORKBENCH_KERNEL_ID": self.kernel_id,
                      "JPY_SESSION_NAME": env.get("JPY_SESSION_NAME", ""),
                      ORPHAN_ENV: f"{self.orphan_after_s:g}"}
        self.dead_reason, self._polled = None, (0.0, None)
        try:
            info = await _off_loop(self._launch, remote_env)
        except TargetError as exc:
            raise RemoteKernelError(f"could not start the Workbench kernel on {self.target}: "
                                    f"{exc}") from None
        self.connection_info = info
        return info

    def _launch(self, env: dict[str, str]) -> KernelConnectionInfo:
        from workbench.targets.backends.remote import LocalTransport, SSHTransport, Transport
        from workbench.targets.named import SlurmTarget, get_target

        target = get_target(self.target)
        if self.orphan_after_s < MIN_ORPHAN_S:  # a kernel.json written by hand, not installed
            raise RemoteKernelError(
                f"this kernel's orphan_after_s is {self.orphan_after_s:g} s: under "
                f"{MIN_ORPHAN_S:g} s it would end whenever its client missed one beat; install it "
                "again with `workbench kernels install TARGET --orphan-after 30s`")
        self._check_budget()
        key = self.connection_info["key"]
        conn = {**self.connection_info, "key": key.decode() if isinstance(key, bytes) else key}
        started = time.time()
        try:
            if isinstance(target, SlurmTarget):
                transport: Transport = LocalTransport()
                if target.login:  # an unreachable login node is refused here, saying why
                    self.tunnel = Tunnel(SSHTransport(target.login, target), self.kernel_id)
                    transport = self.tunnel.connect(target.connect_timeout + 20)
                slurm = SlurmPlacement(target, self.kernel_id, self.gpus, self.time_limit,
                                       self.cpus, transport)
                self.placement = slurm
                ports = slurm.start(conn, env, self.start_timeout_s, self.wait_s)
                started = slurm.started or started
                if self.tunnel is not None:
                    ports = self.tunnel.open(slurm.remote_host, ports)
                ip = "127.0.0.1" if target.login else slurm.remote_host
            else:
                self.tunnel = Tunnel(SSHTransport(target.hosts[0], target), self.kernel_id)
                ssh = SSHPlacement(target, self.tunnel.connect(target.connect_timeout + 20),
                                   self.kernel_id)
                self.placement = ssh
                ports = self.tunnel.open(ssh.remote_host, ssh.start(conn, env,
                                                                    self.start_timeout_s))
                started = float((ssh.identity or {}).get("create_time") or started)
                ip = "127.0.0.1"
            self.session = Session(self.kernel_id, self.target, self.gpus,
                                  orphan_after_s=self.orphan_after_s)
            self.session.open(started, self.placement.job, self.placement.dir,
                              self.placement.identity)
            self.beater = Beater(self._beat, self.log, name=self.kernel_id).start()
        except BaseException:
            self._release("the start failed")
            raise
        self.log.info("Workbench kernel %s on %s: %s", self.kernel_id, self.target,
                      f"Slurm job {self.placement.job}" if self.placement.job else "started")
        info: Any = {**self.connection_info, **ports, "ip": ip}
        return info

    # -- watch -----------------------------------------------------------------------------------
    async def poll(self) -> int | None:
        if self.placement is None:
            return 0
        if self.dead_reason is not None:
            return 1
        checked, code = self._polled
        if time.time() - checked < POLL_EVERY_S:
            return code
        code = await _off_loop(self._poll)
        self._polled = (time.time(), code)
        return code

    def _poll(self) -> int | None:
        assert self.placement is not None
        if self.tunnel is not None and not self.tunnel.alive():
            return self._lose(f"the SSH connection to {self.target} dropped")
        try:
            alive, activity = self.placement.alive_and_activity()
        except (TargetError, RemoteKernelError) as exc:
            if self.tunnel is not None and not self.tunnel.alive():
                return self._lose(f"the SSH connection to {self.target} dropped: {exc}")
            self.log.warning("could not ask %s about kernel %s: %s", self.target, self.kernel_id,
                             exc)
            return None  # nothing is known: ask again
        if not alive:
            if self.session:
                self.session.close("the kernel ended")
            return 0
        if self.session:
            self.session.bill()
            over = self._over_budget()
            if over:
                return self._cull(over)
        if self.cull_idle_s > 0 and activity and not activity.get("busy") and \
                time.time() - float(activity.get("since") or time.time()) > self.cull_idle_s:
            return self._cull()
        return None

    def _beat(self, n: int) -> None:
        placement, session = self.placement, self.session
        if session is not None:
            session.bill()
        if placement is not None:
            res = placement.transport.run(beat_command(placement.dir, n), check=False, timeout=30)
            if res.returncode != 0:
                raise RemoteKernelError(res.text.strip()[-500:])

    def _lose(self, reason: str) -> int:
        self.log.error("Workbench kernel %s is dead: %s; releasing what it held", self.kernel_id,
                       reason)
        self.dead_reason = reason
        self._release(reason)
        return 1

    # -- money -----------------------------------------------------------------------------------
    def _check_budget(self) -> None:
        """Refuse a start a budget cannot keep: no price, or already spent (with the release)."""
        settle(self.kernel_id)  # a past session whose client died is billed as the target saw it
        if self.budget_limit <= 0:
            return
        from workbench.targets.kernels.ledger import hourly_price, spent

        price, currency = hourly_price(self.target, self.gpus)
        if price <= 0:
            raise RemoteKernelError(
                f"this kernel has a budget of {self.budget_limit:g} but {self.target} has no price, "
                "so it could not be kept: set budget.price_per_gpu_hour (or price_per_cpu_core_hour)"
                f" in the defaults of {self.target} in targets.yaml")
        used = spent(self.kernel_id)
        if used + price * STOP_MARGIN_S / 3600 >= self.budget_limit:
            raise RemoteKernelError(
                f"this kernel's budget of {self.budget_limit:g} {currency} is spent ({used:.4g} "
                f"{currency} over its sessions); install it again with a larger --budget")

    def _over_budget(self) -> str | None:
        """Why the kernel must stop now to stay within its budget (None: it may go on). It stops
        while what it has cost plus a poll and its release still fit under the limit."""
        if self.budget_limit <= 0 or self.session is None:
            return None
        from workbench.targets.kernels.ledger import spent

        d = self.session.data
        used = spent(self.kernel_id) + float(d["cost"])
        if used + d["price_per_hour"] * STOP_MARGIN_S / 3600 < self.budget_limit:
            return None
        return (f"stopped at its budget: {used:.4g} of {self.budget_limit:g} {d['currency']} "
                f"spent on {self.target}; install it again with a larger --budget")

    def _cull(self, reason: str | None = None) -> int:
        reason = reason or (f"culled after {self.cull_idle_s:.0f} s idle on {self.target} "
                            f"({self.gpus} GPU(s) held); start it again to get a new allocation")
        stop_restarter = getattr(self.parent, "stop_restarter", None)
        if stop_restarter:  # an auto-restart would ask for the GPUs again at once
            stop_restarter()
        code = self._lose(reason)
        # Under jupyter-server, its MappingKernelManager removes the kernel, so the notebook says
        # it is gone instead of waiting on a kernel that no longer answers.
        servers = getattr(self.parent, "parent", None)
        shutdown = getattr(servers, "shutdown_kernel", None)
        if self._loop is not None and inspect.iscoroutinefunction(shutdown) and \
                self.kernel_id in getattr(servers, "_kernels", {}):
            asyncio.run_coroutine_threadsafe(shutdown(self.kernel_id), self._loop)
        return code

    async def wait(self) -> int | None:
        while (code := await self.poll()) is None:
            await asyncio.sleep(0.5)
        return code

    # -- signals and stop --------------------------------------------------------------------------
    async def send_signal(self, signum: int) -> None:
        if self.placement is not None and self.dead_reason is None and signum:
            await _off_loop(self.placement.signal, signum)
            self._polled = (0.0, None)

    async def terminate(self, restart: bool = False) -> None:
        import signal

        await self.send_signal(signal.SIGTERM)

    async def kill(self, restart: bool = False) -> None:
        if self.placement is not None and self.dead_reason is None:
            await _off_loop(self.placement.stop, 0.5)
            self._polled = (0.0, None)

    async def cleanup(self, restart: bool = False) -> None:
        await _off_loop(self._release, "shut down")

    def _release(self, reason: str) -> None:
        """End the tunnel, the kernel (if it still runs) and the allocation; close the bill."""
        placement, self.placement = self.placement, None
        if self.beater is not None:
            self.beater.stop()
            self.beater = None
        if self.tunnel is not None:
            self.tunnel.close()
            self.tunnel = None
        if placement is not None:
            try:
                if isinstance(placement, SSHPlacement) and placement.identity:
                    placement.stop(grace=2.0)
                placement.release()
            except (TargetError, RemoteKernelError) as exc:
                self.log.error("could not release kernel %s on %s: %s", self.kernel_id,
                               self.target, exc)
        if self.session:
            self.session.close(reason)
            self.session = None

    async def post_launch(self, **kwargs: Any) -> None:
        self._loop = asyncio.get_running_loop()  # where a cull schedules the server's shutdown

    def get_shutdown_wait_time(self, recommended: float = 5.0) -> float:
        return max(recommended, 10.0)  # every look at the kernel is a round trip

    async def get_provisioner_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await super().get_provisioner_info()
        info["workbench"] = {"target": self.target, "job": getattr(self.placement, "job", None)}
        return info
