"""`_core.memory.available_memory`: the figure `Engine.open` checks a KV pool against, read from this
machine's /proc/meminfo and from fake cgroup v1 / v2 trees (a limit minus usage, the smallest level)."""

from __future__ import annotations

from pathlib import Path

from aiobasert._core.memory import available_memory

GIB = 2**30


def meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_the_real_reading_is_at_most_mem_available() -> None:
    before = meminfo_available()
    got = available_memory()
    after = meminfo_available()
    assert got is not None
    free, source = got
    # never more than MemAvailable (a cgroup's headroom can only lower it); the two readings bracket
    # the moment it was read, give or take other processes' churn (1 GiB)
    assert 0 < free <= max(before, after) + GIB
    if source == "MemAvailable":
        assert min(before, after) - GIB <= free


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_tree(root: Path, *, available_kib: int) -> None:
    write(root, "/proc/meminfo", f"MemTotal: 999999999 kB\nMemAvailable: {available_kib} kB\n")


def test_a_cgroup_v2_limit_minus_usage_wins_when_smaller(tmp_path: Path) -> None:
    fake_tree(tmp_path, available_kib=64 * 2**20)  # 64 GiB
    write(tmp_path, "/proc/self/cgroup", "0::/pod/app\n")
    write(tmp_path, "/proc/self/mountinfo", "30 20 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    write(tmp_path, "/sys/fs/cgroup/pod/app/memory.max", "max\n")
    write(tmp_path, "/sys/fs/cgroup/pod/app/memory.current", f"{GIB}\n")
    write(tmp_path, "/sys/fs/cgroup/pod/memory.max", f"{8 * GIB}\n")  # a parent's limit applies too
    write(tmp_path, "/sys/fs/cgroup/pod/memory.current", f"{3 * GIB}\n")
    assert available_memory(str(tmp_path)) == (5 * GIB, "cgroup memory.max - memory.current")


def test_a_cgroup_v1_limit_inside_a_container_s_mount(tmp_path: Path) -> None:
    fake_tree(tmp_path, available_kib=64 * 2**20)
    write(tmp_path, "/proc/self/cgroup", "4:memory:/docker/abc\n1:cpu:/docker/abc\n")
    # the container sees its own cgroup mounted at the controller's mount point
    mount = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    write(tmp_path, "/proc/self/mountinfo", mount)
    write(tmp_path, "/sys/fs/cgroup/memory/memory.limit_in_bytes", f"{2 * GIB}\n")
    write(tmp_path, "/sys/fs/cgroup/memory/memory.usage_in_bytes", f"{GIB // 2}\n")
    assert available_memory(str(tmp_path)) == (GIB + GIB // 2, "cgroup memory.limit_in_bytes - memory.usage_in_bytes")


def test_no_limit_set_leaves_mem_available(tmp_path: Path) -> None:
    fake_tree(tmp_path, available_kib=4 * 2**20)
    write(tmp_path, "/proc/self/cgroup", "4:memory:/\n0::/\n")
    write(tmp_path, "/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")  # v1's "none"
    write(tmp_path, "/sys/fs/cgroup/memory/memory.usage_in_bytes", f"{GIB}\n")
    write(tmp_path, "/sys/fs/cgroup/memory.max", "max\n")
    assert available_memory(str(tmp_path)) == (4 * GIB, "MemAvailable")
    assert available_memory(str(tmp_path / "nothing")) is None
