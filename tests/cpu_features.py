"""The CPU's feature flags as Linux reports them, shared by the kernel-set tests (which set the engine's
kernel choice must match) and bench/vs_llama_server.py (which ISA to build llama-server for)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    """The `flags` of /proc/cpuinfo's first processor; empty where there is none (not Linux, not x86)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
