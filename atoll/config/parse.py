"""Parsing of the settings given as text (Ray resources, failure traces, addresses) and one-line validation errors.

No torch and no strategy here: the command line and the failure traces (:mod:`atoll.analysis.chaos`) use it.
"""

from __future__ import annotations

import ipaddress

from pydantic import ValidationError


def parse_resources(value: str) -> dict[str, float]:
    """``"NAME=AMOUNT[,NAME=AMOUNT]"`` -> {name: amount}: one island's custom Ray resources.

    Raises:
        ValueError: an entry that is not NAME=NUMBER (the message names the fix).
    """
    out: dict[str, float] = {}
    for item in value.split(","):
        name, sep, amount = item.strip().partition("=")
        try:
            out[name.strip()] = float(amount)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"'{item.strip()}' is not NAME=AMOUNT; pass e.g. --ray-island-resources "
                             "'us_east=1;us_east=1;eu_west=1;eu_west=1'")
    return out


def parse_chaos(value: str) -> tuple[float, float]:
    """``"MTBF_S:DOWNTIME_S"`` -> (mean up-time between failures, downtime), seconds, both > 0.

    Raises:
        ValueError: not two positive finite numbers separated by a colon (the message names the fix).
    """
    parts = value.split(":")
    try:
        mtbf, down = (float(x) for x in parts)
        ok = len(parts) == 2 and 0 < mtbf < float("inf") and 0 < down < float("inf")
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"'{value}' is not MTBF_S:DOWNTIME_S with two positive numbers of seconds; "
                         "pass e.g. --chaos 90:10 (down about 10% of the time)")
    return mtbf, down


def parse_address(text: str, field: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port).

    Raises:
        ValueError: one line naming ``field``: no port, a port outside 1..65535 (0 for ``listen``: any), or no host.
    """
    host, sep, port = str(text).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    low = 0 if field == "listen" else 1
    if not sep or not host or not port.isdigit() or not low <= int(port) <= 65535:
        raise ValueError(f"{field}: '{text}' is not HOST:PORT with a port in {low}..65535; pass e.g. "
                         f"--{field} {'0.0.0.0' if field == 'listen' else 'syncer.example.org'}:7070")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Does ``host`` name this machine only (``localhost``, 127.0.0.0/8, ::1)? Names are not resolved."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def fix_hint(field: str) -> str:
    """How to fix a setting: its flag or TOML key."""
    flag = "--" + field.replace("_", "-")
    return f"set {flag} (or '{field}' in the TOML file) to a valid value; see 'atoll train --help'"


def format_validation_error(err: ValidationError) -> str:
    """The first error of a pydantic validation as one line: ``field: what is wrong; the fix``."""
    first = err.errors()[0]
    names = [str(p) for p in first["loc"] if not isinstance(p, int)]  # a list's item: its setting, which item
    items = [p for p in first["loc"] if isinstance(p, int)]
    loc = ".".join(names) or "config"
    msg = first["msg"] + (f" (item {items[0] + 1} of the list)" if items else "")
    if first["type"] == "extra_forbidden":
        return f"{loc}: unknown setting; remove it (known settings: 'atoll train --help')"
    if msg.startswith("Value error, "):
        text = msg[len("Value error, "):]
        return text if loc == "config" else f"{loc}: {text}"
    got = first.get("input")
    got_s = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    return f"{loc}: {msg[0].lower() + msg[1:]}{got_s}; {fix_hint(loc)}"
