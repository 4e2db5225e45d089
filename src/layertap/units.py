"""Sizes for people, one way everywhere: decimal units, as disks and ``df -H`` count them.

>>> from layertap.units import human_bytes
>>> human_bytes(512), human_bytes(1_500_000), human_bytes(3.2e12)
('512 B', '1.5 MB', '3.2 TB')
"""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """A byte count for people: ``1.5 GB``."""
    unit = "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


__all__ = ["human_bytes"]
