"""How much memory a node can still give this process, and handing freed heap memory back to the system.

Layer: shared infrastructure (``lightning_fsdp.distributed``), used by loading and saving; not part of the core.
"""

import ctypes
from contextlib import suppress
from pathlib import Path

#: cgroup v1 reports "no limit" as a number close to 2**63.
_CGROUP_V1_UNLIMITED = 1 << 60


def available_memory(
    meminfo: str = "/proc/meminfo", self_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"
) -> int | None:
    """The bytes of memory this process's node can still give it: the system's, bounded by its cgroup's limit.

    The system's share is ``MemAvailable`` in ``/proc/meminfo`` (or ``psutil`` where there is no ``/proc``); the
    cgroup's is the smallest ``limit - usage`` over the process's cgroup and its ancestors (v2, or v1's memory
    controller). ``None`` if neither can be found.

    """
    found = (_system_available(meminfo), _cgroup_available(self_cgroup, cgroup_root))
    known = [value for value in found if value is not None]
    return min(known) if known else None


def return_freed_memory() -> None:
    """Return the heap memory that freed tensors leave behind to the system (glibc only; elsewhere a no-op).

    Tensors below glibc's mmap threshold (up to 32 MiB) come from the heap, and glibc keeps freed heap memory for
    reuse: without this, a process would still hold most of a materialised source after freeing it.

    """
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _system_available(meminfo: str) -> int | None:
    try:
        text = Path(meminfo).read_text()
    except OSError:
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.virtual_memory().available)
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            value, *unit = line.split()[1:]
            return int(value) * (1024 if unit and unit[0].lower() == "kb" else 1)
    return None


def _cgroup_available(self_cgroup: str, cgroup_root: str) -> int | None:
    """The smallest ``limit - usage`` over the process's cgroup and its ancestors (v2, or v1's memory controller).

    Usage counts page cache that can be reclaimed (``inactive_file``) as free, as the kernel would before it kills.

    """
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(cgroup_root)
    available = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if hierarchy == "0" and not controllers:  # v2: the unified hierarchy, mounted at the root or under "unified"
            for mount in (root, root / "unified"):
                available.append(_walk_cgroup(mount, relative, "memory.max", "memory.current", "inactive_file"))
        elif "memory" in controllers.split(","):  # v1
            available.append(
                _walk_cgroup(
                    root / "memory", relative, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
                )
            )
    known = [value for value in available if value is not None]
    return min(known) if known else None


def _walk_cgroup(mount: Path, relative: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    # Inside a container the process's cgroup is usually the mount's root; on a host it is the path under the mount.
    directory = mount / relative
    if not directory.is_dir():
        directory = mount
    available = []
    while True:
        value = _cgroup_level_available(directory, limit_file, usage_file, inactive_key)
        if value is not None:
            available.append(value)
        if directory == mount or mount not in directory.parents:
            break
        directory = directory.parent
    return min(available) if available else None


def _cgroup_level_available(directory: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _CGROUP_V1_UNLIMITED:
            return None
        usage = int((directory / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
                break
    except (OSError, ValueError):
        pass
    return max(int(limit_text) - max(usage - inactive, 0), 0)
