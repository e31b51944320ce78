"""The "Python (Workbench)" kernelspec is installed and starts with the magics and widgets ready."""

from __future__ import annotations

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import start_new_kernel


def test_kernelspec_is_installed_with_its_display_name() -> None:
    spec = KernelSpecManager().get_kernel_spec("workbench")
    assert spec.display_name == "Python (Workbench)"
    assert spec.argv[1:3] == ["-m", "workbench.targets.kernels.kernel"]


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


def _cell(kc, code: str) -> tuple[dict, list[dict]]:
    msgs: list[dict] = []
    reply = kc.execute_interactive(code, timeout=120, output_hook=msgs.append)
    return reply["content"], msgs


def test_a_workbench_error_shows_as_its_message_with_the_traceback_a_click_away(wb_home) -> None:
    """In a plain Python kernel, after `import workbench`: the cell fails (run-all stops there)
    but what shows is the error's type and message; the frames are in a collapsed block and
    behind %tb. Other exceptions keep IPython's usual traceback."""
    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=120)
    try:
        reply, msgs = _cell(kc, "import workbench\n"
                                "workbench.RunSpec(train={'learning_rate': 1e-4})")
        tb_reply, tb_msgs = _cell(kc, "%tb")
        other, other_msgs = _cell(kc, "def f():\n    return 1 / 0\nf()")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert reply["status"] == "error" and reply["ename"] == "SpecError"
    [error] = [m["content"] for m in msgs if m["msg_type"] == "error"]
    assert error["traceback"] == [
        "SpecError: invalid run spec:",
        "  train.learning_rate: unknown field 'learning_rate'; did you mean 'lr'? allowed "
        "fields: batch_size, epochs, eval_every, fast, grad_accum, gradient_checkpointing, "
        "log_every, lr, master_weights, max_grad_norm, max_steps, optimizer, "
        "optimizer_in_backward, scheduler, seed, warmup_ratio, weight_decay"]
    [shown] = [m["content"]["data"] for m in msgs if m["msg_type"] == "display_data"]
    assert "<details>" in shown["text/html"] and "RunSpec(train=" in shown["text/html"]
    [full] = [m["content"]["traceback"] for m in tb_msgs if m["msg_type"] == "error"]
    printed = "\n".join(full)  # %tb: IPython's own traceback of the last error, every frame
    assert "SpecError" in printed and "RunSpec(train=" in printed and "__init__" in printed
    [plain] = [m["content"] for m in other_msgs if m["msg_type"] == "error"]
    assert plain["ename"] == "ZeroDivisionError" and len(plain["traceback"]) > 2
