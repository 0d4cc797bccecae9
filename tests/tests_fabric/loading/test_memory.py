"""What memory a node can still give: MemAvailable, bounded by the cgroup's limit (v1, v2, nested, in a container)."""

import os
import sys

import pytest

from lightning_fsdp.distributed.memory import available_memory

_GiB = 1 << 30


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _meminfo(tmp_path, available_kb=50 * 1024 * 1024):
    path = tmp_path / "meminfo"
    _write(path, f"MemTotal:       67108864 kB\nMemFree:         1000 kB\nMemAvailable:   {available_kb} kB\n")
    return str(path)


def test_available_memory_without_cgroup_limit(tmp_path):
    self_cgroup = tmp_path / "self_cgroup"
    _write(self_cgroup, "0::/job\n")
    _write(tmp_path / "cg" / "job" / "memory.max", "max\n")
    available = available_memory(_meminfo(tmp_path), str(self_cgroup), str(tmp_path / "cg"))
    assert available == 50 * _GiB


def test_available_memory_without_proc(tmp_path, monkeypatch):
    missing = str(tmp_path / "missing")
    # psutil (where it is installed) answers on systems without /proc/meminfo.
    psutil = pytest.importorskip("psutil")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 3 * _GiB})())
    assert available_memory(missing, missing, missing) == 3 * _GiB
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert available_memory(missing, missing, missing) is None


def test_available_memory_cgroup_v2_limit_of_an_ancestor(tmp_path):
    self_cgroup = tmp_path / "self_cgroup"
    _write(self_cgroup, "0::/slurm/job_1/step_0\n")
    root = tmp_path / "cg"
    _write(root / "slurm" / "job_1" / "step_0" / "memory.max", "max\n")
    _write(root / "slurm" / "job_1" / "memory.max", f"{32 * _GiB}\n")
    _write(root / "slurm" / "job_1" / "memory.current", f"{20 * _GiB}\n")
    # 4 GiB of the usage is page cache the kernel can drop: it counts as available.
    _write(root / "slurm" / "job_1" / "memory.stat", f"anon 1\ninactive_file {4 * _GiB}\nactive_file 7\n")
    assert available_memory(_meminfo(tmp_path), str(self_cgroup), str(root)) == 16 * _GiB


def test_available_memory_cgroup_v2_inside_a_container(tmp_path):
    # With a cgroup namespace the process sees its own cgroup as the root of the mount.
    self_cgroup = tmp_path / "self_cgroup"
    _write(self_cgroup, "0::/\n")
    root = tmp_path / "cg"
    _write(root / "memory.max", f"{8 * _GiB}\n")
    _write(root / "memory.current", f"{2 * _GiB}\n")
    assert available_memory(_meminfo(tmp_path), str(self_cgroup), str(root)) == 6 * _GiB


def test_available_memory_cgroup_v1(tmp_path):
    self_cgroup = tmp_path / "self_cgroup"
    _write(self_cgroup, "5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n")
    root = tmp_path / "cg"
    _write(root / "memory" / "docker" / "abc" / "memory.limit_in_bytes", f"{12 * _GiB}\n")
    _write(root / "memory" / "docker" / "abc" / "memory.usage_in_bytes", f"{5 * _GiB}\n")
    _write(root / "memory" / "docker" / "abc" / "memory.stat", f"inactive_file 1\ntotal_inactive_file {_GiB}\n")
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # "unlimited"
    _write(root / "memory" / "memory.usage_in_bytes", f"{40 * _GiB}\n")
    assert available_memory(_meminfo(tmp_path), str(self_cgroup), str(root)) == 8 * _GiB
    # A limit larger than what the system has free does not raise the estimate.
    assert available_memory(_meminfo(tmp_path, 1024 * 1024), str(self_cgroup), str(root)) == _GiB


def test_available_memory_on_this_machine():
    available = available_memory()
    if os.path.exists("/proc/meminfo"):
        assert available is not None
        assert available > 0
