"""HMAC-SHA256 authentication of what crosses the bus: record MACs and directive signatures.

Both use the run's directive secret; a domain prefix keeps record MACs apart from directive
signatures made with the same key. Comparisons are constant-time, on bytes (``compare_digest``
refuses a str with non-ASCII characters, a forger's choice).
"""

from __future__ import annotations

import hmac


def directive_signature(secret: bytes, canonical: bytes) -> str:
    """The ``sig`` of a directive: HMAC-SHA256 over its canonical JSON body (``Directive.canonical``), hex."""
    return hmac.digest(secret, canonical, "sha256").hex()


def signature_matches(want: str, got: str) -> bool:
    """Constant-time comparison of a computed hex digest with one read from the bus."""
    return hmac.compare_digest(want.encode(), got.encode("utf-8", "surrogatepass"))


RECORD_MAC_FIELD = "mac"  # stream field beside ``json``: HMAC-SHA256 of the exact JSON text


def record_mac(secret: bytes, stream: str, data: str) -> str:
    """HMAC-SHA256 over (domain, stream key, record JSON text), hex.

    The trainer MACs every step record and ack it puts on the bus with the run's directive
    secret; the sentinel refuses entries whose MAC is missing or wrong, so whoever can write to
    the bus but does not hold the secret cannot make the sentinel act. The stream key binds a
    record to its run and stream (no replay into another run), and the domain prefix keeps these
    MACs apart from directive signatures made with the same key.
    """
    msg = b"sentinel-record-v1\x00" + stream.encode() + b"\x00" + data.encode("utf-8", "surrogatepass")
    return hmac.digest(secret, msg, "sha256").hex()  # one C call (hmac.new's wrapper costs as much again)


def record_mac_error(secret: bytes, stream: str, data: str, mac: str | None) -> str | None:
    """None when ``mac`` authenticates ``data`` on ``stream``; else the reject reason."""
    if not mac:
        return "unsigned"
    if not signature_matches(record_mac(secret, stream, data), mac):
        return "bad_signature"
    return None
