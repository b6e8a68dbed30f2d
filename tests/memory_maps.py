"""What Linux says about this process's memory mappings (``/proc/self/smaps``)."""

from __future__ import annotations

from pathlib import Path


def vm_flags(address: int) -> list[str]:
    """The kernel's flags of the mapping that holds ``address`` ("hg": advised as huge
    pages)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
