"""How much memory the box has and has free: /proc/meminfo on unified memory, nvidia-smi on GPUs.

On a DGX Spark the GPU shares the system's 128 GB (unified memory), so MemTotal and
MemAvailable are the truth.  Where `nvidia-smi` exists and reports dedicated GPU memory, that
is what engines compete for.  Both are edges of the system: the actors only see the numbers.
"""

from __future__ import annotations

import asyncio
import shutil


def _meminfo(path: str, key: str) -> int:
    with open(path, encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{path}: no {key} line")


def meminfo_total(path: str = "/proc/meminfo") -> int:
    """MemTotal in bytes."""
    return _meminfo(path, "MemTotal")


async def _nvidia_smi(query: str) -> int | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = await asyncio.create_subprocess_exec(
            exe,
            f"--query-gpu={query}",
            "--format=csv,noheader,nounits",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
    except (OSError, TimeoutError):
        return None
    values = []
    for line in out.decode("ascii", "replace").splitlines():
        line = line.strip()
        if line.isdigit():
            values.append(int(line) * 1024 * 1024)  # MiB
    # "[N/A]" on unified-memory GPUs: fall back to the system's memory.
    return sum(values) if values else None


async def detect_total_bytes() -> tuple[int, str]:
    """(total memory engines share, where the number came from)."""
    gpu = await _nvidia_smi("memory.total")
    if gpu is not None:
        return gpu, "nvidia-smi"
    return await asyncio.to_thread(meminfo_total), "MemTotal"


class MemInfoSource:
    """`actors.ports.MemorySource`: MemAvailable from /proc/meminfo."""

    def __init__(self, path: str = "/proc/meminfo") -> None:
        self.path = path

    async def free_bytes(self) -> int:
        """MemAvailable in bytes."""
        return await asyncio.to_thread(_meminfo, self.path, "MemAvailable")


class GpuFreeSource:
    """`actors.ports.MemorySource`: the GPUs' free memory from nvidia-smi."""

    async def free_bytes(self) -> int:
        """memory.free summed over GPUs, in bytes."""
        free = await _nvidia_smi("memory.free")
        if free is None:
            raise OSError("nvidia-smi did not report memory.free")
        return free


async def detect_source() -> tuple[MemInfoSource | GpuFreeSource, str]:
    """The free-memory source for this box."""
    if await _nvidia_smi("memory.free") is not None:
        return GpuFreeSource(), "nvidia-smi"
    return MemInfoSource(), "MemAvailable"


async def detect_gpu() -> bool:
    """Whether `nvidia-smi` lists a GPU (also on unified memory, where it has no memory.free)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    try:
        proc = await asyncio.create_subprocess_exec(
            exe,
            "--query-gpu=name",
            "--format=csv,noheader",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
    except (OSError, TimeoutError):
        return False
    return proc.returncode == 0 and bool(out.strip())
