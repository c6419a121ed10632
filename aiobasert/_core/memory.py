"""How much memory this process can still take: the check `Engine.open` makes before it uses a KV pool.

The figure is the smallest of /proc/meminfo's MemAvailable and, for every memory cgroup the process
sits in (v2 `memory.max` / `memory.current`, v1 `memory.limit_in_bytes` / `memory.usage_in_bytes`, each
level from the process's own cgroup up to its hierarchy's mount point), the limit minus the usage. The
mounts and the process's cgroups are read from /proc/self/mountinfo and /proc/self/cgroup, as
native/src/cgroup.c reads them for the engine's CPU and memory limits. `root` prefixes every path (tests
point it at a fake tree). A figure that cannot be read is left out; none at all gives None.
"""

from __future__ import annotations

import os

__all__ = ["available_memory"]

_NO_LIMIT = 1 << 60  # v1 says "no limit" with a huge, page-rounded LLONG_MAX


def available_memory(root: str = "") -> tuple[int, str] | None:
    """(bytes, where the figure comes from), or None where this system says nothing (not Linux)."""
    found: list[tuple[int, str]] = []
    meminfo = _meminfo_available(root)
    if meminfo is not None:
        found.append((meminfo, "MemAvailable"))
    for hierarchy in _memory_hierarchies(root):
        headroom = _smallest_headroom(*hierarchy)
        if headroom is not None:
            found.append(headroom)
    return min(found) if found else None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _meminfo_available(root: str) -> int | None:
    for line in (_read(f"{root}/proc/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            fields = rest.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) * 1024
    return None


def _memory_hierarchies(root: str) -> list[tuple[str, str, str, str]]:
    """(first dir, stop dir, limit file, usage file) for the v2 and v1 memory hierarchies the process is in."""
    cgroups: dict[str, str] = {}  # "v2" / "v1" -> the process's cgroup path there
    for line in (_read(f"{root}/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            cgroups["v2"] = parts[2]
        elif "memory" in parts[1].split(","):
            cgroups["v1"] = parts[2]
    mounts = {"v2": ("/", "/sys/fs/cgroup"), "v1": ("/", "/sys/fs/cgroup/memory")}  # (mount root, mount point)
    for line in (_read(f"{root}/proc/self/mountinfo") or "").splitlines():
        head, sep, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(after) < 3:
            continue
        if after[0] == "cgroup2":
            mounts["v2"] = (fields[3], fields[4])
        elif after[0] == "cgroup" and "memory" in after[2].split(","):
            mounts["v1"] = (fields[3], fields[4])
    files = {"v2": ("memory.max", "memory.current"), "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}
    out = []
    for kind, path in cgroups.items():
        mroot, mount = mounts[kind]
        if mroot != "/":  # a container's view: its cgroup path is relative to the part mounted
            path = path[len(mroot) :] if path == mroot or path.startswith(mroot + "/") else ""
        base = root + (mount if mount != "/" else "")
        out.append((base + path.rstrip("/"), base, *files[kind]))
    return out


def _smallest_headroom(first: str, stop: str, limit_file: str, usage_file: str) -> tuple[int, str] | None:
    """The smallest limit minus usage from `first` up to `stop`; None where no level sets a limit."""
    best: tuple[int, str] | None = None
    here = first
    while True:
        limit, usage = _number(os.path.join(here, limit_file)), _number(os.path.join(here, usage_file))
        if limit is not None and 0 < limit < _NO_LIMIT and usage is not None:
            headroom = (max(0, limit - usage), f"cgroup {limit_file} - {usage_file}")
            best = headroom if best is None else min(best, headroom)
        if len(here) <= len(stop) or "/" not in here[len(stop) :]:
            break
        here = here.rsplit("/", 1)[0]
    return best


def _number(path: str) -> int | None:
    text = (_read(path) or "").strip()
    return int(text) if text.isdigit() else None
