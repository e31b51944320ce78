"""The GPU table: defaults, user overrides in $WORKBENCH_HOME/gpus.yaml, lookup and detection."""

from __future__ import annotations

import psutil
import pytest
import torch
import yaml

from workbench.errors import WorkbenchError
from workbench.gpus import (
    GPUTableError,
    UnknownGPUError,
    detect_gpu_type,
    edit_gpu,
    get_gpu,
    gpu_table,
    gpu_type_from_device_name,
    overrides_path,
)


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_HOME", str(tmp_path / "home"))


def test_defaults_cover_common_cards_with_issue_4_prices():
    table = gpu_table()
    for name in ("H200", "H100", "A100-80G", "A100-40G", "L40S", "A10G", "RTX 4090", "RTX 3090",
                 "V100", "T4", "CPU"):
        assert name in table
        assert table[name].bf16_tflops > 0
    # The small GPU cloud's list prices per card-hour (issue 4), in CNY.
    prices = {n: table[n].price_per_hour for n in ("A100-80G", "A100-40G", "H100", "RTX 4090")}
    assert prices == {"A100-80G": 3.75, "A100-40G": 3.6, "H100": 9.9, "RTX 4090": 1.2}
    assert {table[n].currency for n in prices} == {"CNY"}
    assert table["A100-80G"].memory_gib == 80.0 and table["A100-40G"].memory_gib == 40.0


def test_cpu_entry_is_host_ram():
    cpu = get_gpu("CPU")
    assert cpu.memory_gib == pytest.approx(psutil.virtual_memory().total / 2**30)


@pytest.mark.parametrize("spelling", ["a100-80g", "A100_80G", "a100 80g", "A10080G"])
def test_lookup_ignores_case_and_separators(spelling):
    assert get_gpu(spelling).name == "A100-80G"


def test_unknown_gpu_lists_known_ones():
    with pytest.raises(UnknownGPUError) as info:
        get_gpu("GTX 480")
    msg = str(info.value)
    assert "GTX 480" in msg and "A100-80G" in msg and "RTX 4090" in msg and "gpus.yaml" in msg
    assert isinstance(info.value, WorkbenchError)


def test_user_overrides_merge_and_add_cards():
    overrides_path().write_text(yaml.safe_dump({
        "rtx-4090": {"price_per_hour": 1.5},
        "MyCloud-L20": {"memory_gib": 45, "bf16_tflops": 119.5, "price_per_hour": 2.6},
    }))
    table = gpu_table()
    assert table["RTX 4090"].price_per_hour == 1.5
    assert table["RTX 4090"].memory_gib == 24.0  # untouched fields keep their default
    assert get_gpu("mycloud l20").bf16_tflops == 119.5


@pytest.mark.parametrize("content, needle", [
    ({"H100": {"pryce": 1}}, "unknown field"),
    ({"NewCard": {"price_per_hour": 1}}, "memory_gib"),
    (["not", "a", "mapping"], "must map card names"),
])
def test_bad_overrides_say_what_is_wrong(content, needle):
    overrides_path().write_text(yaml.safe_dump(content))
    with pytest.raises(GPUTableError, match=needle):
        gpu_table()


def test_edit_gpu_persists():
    assert edit_gpu("h100", price_per_hour=12.0).price_per_hour == 12.0
    saved = yaml.safe_load(overrides_path().read_text())
    assert saved == {"H100": {"price_per_hour": 12.0}}
    assert get_gpu("H100").price_per_hour == 12.0
    with pytest.raises(GPUTableError):
        edit_gpu("H100", speed=3)


@pytest.mark.parametrize("device, mem, expected", [
    ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80G"),
    ("NVIDIA A100-PCIE-40GB", 39.4, "A100-40G"),
    ("NVIDIA H100 80GB HBM3", 79.6, "H100"),
    ("NVIDIA H200", 139.8, "H200"),
    ("NVIDIA GeForce RTX 4090", 23.6, "RTX 4090"),
    ("Tesla T4", 14.7, "T4"),
    ("NVIDIA RTX 6000 Ada Generation", 47.5, None),
])
def test_device_names_map_to_table(device, mem, expected):
    assert gpu_type_from_device_name(device, mem) == expected


def test_detect_gpu_type_matches_this_machine():
    detected = detect_gpu_type()
    if not torch.cuda.is_available():
        assert detected is None
    else:  # pragma: no cover - GPU machines
        assert detected is None or detected in gpu_table()
