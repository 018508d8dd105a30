"""``host:port`` as the WAN tools take it (``[v6]:port`` for IPv6), checked before any socket opens."""

from __future__ import annotations

import ipaddress


def parse_address(value: str, name: str = "address", *, allow_port_zero: bool = False) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``) so CLI typos fail before any socket is opened."""
    text = value.strip()
    host: str
    port_text: str
    if text.startswith("["):
        end = text.find("]")
        if end == -1 or text[end + 1 : end + 2] != ":":
            raise ValueError(f"malformed {name} {value!r}: expected [IPV6]:PORT")
        host, port_text = text[1:end], text[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"malformed {name} {value!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"malformed {name} {value!r}: expected HOST:PORT, e.g. 127.0.0.1:7000")
        if ":" in host:
            raise ValueError(f"malformed {name} {value!r}: wrap IPv6 hosts in brackets, e.g. [::1]:7000")
    if not port_text.isdigit():
        raise ValueError(f"malformed {name} {value!r}: port {port_text!r} is not a number")
    port = int(port_text)
    low = 0 if allow_port_zero else 1
    if not low <= port <= 65535:
        raise ValueError(f"malformed {name} {value!r}: port must be in {low}..65535, got {port}")
    return host, port
