"""Byte sizes: the binary units every module counts in, and how a size is shown to a person.

``KiB``, ``MiB``, ``GiB`` are powers of two (IEC); rates stay decimal (GB/s = 10^9 bytes per
second, as the benchmarks and logs report them). :func:`gib_text` is the one spelling of a
size in messages: ``12.50 GiB``, or with ``exact`` also the byte count the numbers come from.
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def gib_text(nbytes: int | float, digits: int = 2, *, exact: bool = False) -> str:
    """``nbytes`` in GiB with ``digits`` decimals (``12.50 GiB``); ``exact`` appends the byte
    count (``12.5 GiB (13421772800 bytes)``)."""
    text = f"{nbytes / GiB:.{digits}f} GiB"
    return f"{text} ({int(nbytes)} bytes)" if exact else text
