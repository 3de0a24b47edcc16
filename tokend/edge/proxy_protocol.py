"""The PROXY protocol header, versions 1 and 2, as a receiver reads it: pure, bytes in.

The specification is HAProxy's "The PROXY protocol, Versions 1 & 2" (2020/03/05,
doc/proxy-protocol.txt in HAProxy's sources); section numbers below are its. A load
balancer relaying a TCP connection (HAProxy's ``send-proxy`` / ``send-proxy-v2``)
writes the header once, before any byte of the client's, so that the receiver learns
the client's address instead of the balancer's.

:func:`parse` takes the bytes a connection has received so far and answers None (the
header is not complete yet), a :class:`ProxyHeader` (its addresses and the bytes that
follow it), or raises :class:`ProxyHeaderError` naming what is wrong. :func:`starts_header`
tells whether bytes begin like a header at all, for connections that must not send one.

Which connections must send a header is configuration, never a guess from the bytes
(section 5: a client allowed to send one could claim any address): see
``proxy_protocol_from`` in tokend/config.py and tokend/server/connection.py.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

# Section 2.2: the 12-byte signature that starts a version 2 header.
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
# Section 2.1: a version 1 header starts with "PROXY" and one space.
V1_PREFIX = b"PROXY "
# Section 2.1: the longest version 1 line, CRLF included ("PROXY UNKNOWN" and two
# IPv6 addresses and ports); no CRLF within it: invalid.
V1_MAX_LENGTH = 107
# Section 2.2: signature, version and command, family and protocol, address length.
V2_FIXED = struct.Struct("!12sBBH")
V2_VERSION = 0x2
V2_LOCAL, V2_PROXY = 0x0, 0x1
# Section 2.2, "In practice, the following protocol bytes are expected" (family in
# the high four bits, transport in the low four): the least address length of each.
V2_TCP4, V2_UDP4, V2_TCP6, V2_UDP6, V2_UNIX_STREAM, V2_UNIX_DGRAM = (
    0x11,
    0x12,
    0x21,
    0x22,
    0x31,
    0x32,
)
_V2_ADDRESS_LENGTHS = {
    0x00: 0,
    V2_TCP4: 12,
    V2_UDP4: 12,
    V2_TCP6: 36,
    V2_UDP6: 36,
    V2_UNIX_STREAM: 216,
    V2_UNIX_DGRAM: 216,
}
_V2_IP4 = struct.Struct("!4s4sHH")
_V2_IP6 = struct.Struct("!16s16sHH")

Address = tuple[str, int]


class ProxyHeaderError(ValueError):
    """Bytes that are not a valid PROXY protocol header; the message says why."""


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    """A complete header.

    ``source`` and ``destination`` are the client's and the balancer's (host, port) as
    the balancer saw the relayed connection; both None where the header carries no
    address to use and the connection's own endpoints stand (a version 2 LOCAL command:
    the balancer's own health check; version 1 UNKNOWN; version 2 AF_UNSPEC or AF_UNIX).
    ``rest`` is what the connection received after the header: the client's first bytes.
    """

    version: int
    source: Address | None
    destination: Address | None
    rest: bytes


def starts_header(data: bytes) -> bool | None:
    """Whether ``data`` begins with a PROXY protocol header's signature (either
    version's); None while it is a proper prefix of one and could still become one."""
    for signature in (V1_PREFIX, V2_SIGNATURE):
        if data.startswith(signature):
            return True
        if signature.startswith(data):
            return None
    return False


def parse(data: bytes) -> ProxyHeader | None:
    """The header at the start of ``data``, or None until all of it has arrived.

    Raises :class:`ProxyHeaderError` as soon as the bytes cannot become a valid header
    (section 2.1: "Any sequence which does not exactly match the protocol must be
    discarded and cause the receiver to abort the connection").
    """
    begins = starts_header(data)
    if begins is None:
        return None
    if not begins:
        raise ProxyHeaderError("not a PROXY protocol header")
    if data.startswith(V2_SIGNATURE):
        return _parse_v2(data)
    return _parse_v1(data)


def _parse_v1(data: bytes) -> ProxyHeader | None:
    """Section 2.1: one line of US-ASCII, ``PROXY TCP4|TCP6 src dst sport dport\\r\\n``
    with exactly one space between fields, or ``PROXY UNKNOWN`` and anything up to CRLF."""
    end = data.find(b"\r\n", 0, V1_MAX_LENGTH)
    if end < 0:
        if len(data) >= V1_MAX_LENGTH:
            raise ProxyHeaderError(f"version 1: no CRLF within {V1_MAX_LENGTH} bytes")
        if b"\n" in data or b"\r" in data[:-1]:
            raise ProxyHeaderError("version 1: a line must end with CRLF, not CR or LF alone")
        return None
    line, rest = data[:end], data[end + 2 :]
    if b"\n" in line or b"\r" in line:
        raise ProxyHeaderError("version 1: a line must end with CRLF, not CR or LF alone")
    fields = line.split(b" ")
    if fields[1] == b"UNKNOWN":
        # "the receiver must ignore anything presented before the CRLF is found"
        return ProxyHeader(1, None, None, rest)
    if fields[1] not in (b"TCP4", b"TCP6"):
        raise ProxyHeaderError(
            f"version 1: protocol must be TCP4, TCP6 or UNKNOWN, not {_shown(fields[1])}"
        )
    if len(fields) != 6:
        raise ProxyHeaderError(
            "version 1: expected PROXY, the protocol, two addresses and two ports, "
            "each after exactly one space"
        )
    kind = ipaddress.IPv4Address if fields[1] == b"TCP4" else ipaddress.IPv6Address
    source_ip, destination_ip = (_v1_address(kind, raw) for raw in fields[2:4])
    source_port, destination_port = (_v1_port(raw) for raw in fields[4:6])
    return ProxyHeader(1, (source_ip, source_port), (destination_ip, destination_port), rest)


def _v1_address(kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address], raw: bytes) -> str:
    """An address in its canonical text form (section 2.1: IPv4 in dotted decimal
    without leading zeros, IPv6 in hexadecimal groups), of the announced family."""
    family = "TCP4" if kind is ipaddress.IPv4Address else "TCP6"
    try:
        text = raw.decode("ascii")
        if "%" in text:  # a scope id is no part of an address on the wire
            raise ValueError
        return str(kind(text))
    except ValueError:
        raise ProxyHeaderError(f"version 1: {_shown(raw)} is not a {family} address") from None


def _v1_port(raw: bytes) -> int:
    """Section 2.1: a decimal integer 0..65535, no leading zeros."""
    if not (raw.isdigit() and (raw == b"0" or raw[:1] != b"0") and int(raw) <= 0xFFFF):
        raise ProxyHeaderError(f"version 1: {_shown(raw)} is not a port (0..65535)")
    return int(raw)


def _parse_v2(data: bytes) -> ProxyHeader | None:
    """Section 2.2: the 16-byte fixed part, then ``length`` bytes of addresses and
    TLVs (section 2.2.1 to 2.2.8; skipped: tokend uses none of them)."""
    if len(data) < V2_FIXED.size:
        return None
    _, version_command, family_protocol, length = V2_FIXED.unpack_from(data)
    if version_command >> 4 != V2_VERSION:
        raise ProxyHeaderError(f"version 2: version must be 2, not {version_command >> 4}")
    command = version_command & 0x0F
    if command not in (V2_LOCAL, V2_PROXY):
        raise ProxyHeaderError(f"version 2: command must be LOCAL or PROXY, not {command:#x}")
    end = V2_FIXED.size + length
    if command == V2_PROXY:
        # Checked before the whole header has come: a bad one is refused at once.
        least = _V2_ADDRESS_LENGTHS.get(family_protocol)
        if least is None:
            raise ProxyHeaderError(
                f"version 2: family and protocol {family_protocol:#04x} are not defined"
            )
        if family_protocol in (V2_UDP4, V2_UDP6, V2_UNIX_DGRAM):
            raise ProxyHeaderError("version 2: a datagram (UDP) connection cannot reach a TCP port")
        if length < least:
            raise ProxyHeaderError(
                f"version 2: {length} bytes of addresses, {least} needed for "
                f"family and protocol {family_protocol:#04x}"
            )
    if len(data) < end:
        return None
    rest = data[end:]
    if command == V2_LOCAL or family_protocol not in (V2_TCP4, V2_TCP6):
        # LOCAL: "the receiver must ... use the real connection endpoints and discard
        # the protocol block including the family". AF_UNSPEC: "should ignore address
        # information"; AF_UNIX: no IP address, handled as UNSPEC (allowed).
        return ProxyHeader(2, None, None, rest)
    layout, kind = (
        (_V2_IP4, ipaddress.IPv4Address)
        if family_protocol == V2_TCP4
        else (_V2_IP6, ipaddress.IPv6Address)
    )
    source, destination, source_port, destination_port = layout.unpack_from(data, V2_FIXED.size)
    return ProxyHeader(
        2,
        (str(kind(source)), source_port),
        (str(kind(destination)), destination_port),
        rest,
    )


def _shown(raw: bytes) -> str:
    """A field as an error message shows it: printable, and short."""
    return repr(raw[:48])[1:]
