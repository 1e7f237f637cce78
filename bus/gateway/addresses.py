"""Which addresses to listen on are private to this machine (no third-party imports: the
command line asks before the web extra is loaded)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True if ``host`` (a name or an address to listen on) is ``localhost`` or a loopback
    address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
