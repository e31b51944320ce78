"""The "Python (Workbench)" kernelspec is installed and starts with the magics and widgets ready."""

from __future__ import annotations

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import start_new_kernel


def test_kernelspec_is_installed_with_its_display_name() -> None:
    spec = KernelSpecManager().get_kernel_spec("workbench")
    assert spec.display_name == "Python (Workbench)"
    assert spec.argv[1:3] == ["-m", "workbench.kernels.kernel"]


def test_kernel_starts_with_workbench_magics_loaded(wb_home) -> None:
    km, kc = start_new_kernel(kernel_name="workbench", startup_timeout=120)
    out: list[str] = []

    def collect(msg: dict) -> None:
        content = msg["content"]
        out.append(content.get("text") or content.get("data", {}).get("text/plain", "")
                   or content.get("evalue", ""))

    try:
        reply = kc.execute_interactive("%workbench status\nprint(RunSpec.__name__, RunForm.__name__)",
                                       timeout=120, output_hook=collect)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    text = "".join(out)
    assert reply["content"]["status"] == "ok", text
    assert "RUN" in text and "STATE" in text and "RunSpec RunForm" in text
