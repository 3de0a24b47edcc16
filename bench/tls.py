"""Scenario: what TLS costs (tokend/tls.py), for heartbeats and for new sessions.

The heartbeat closed loop (:mod:`bench.heartbeat`) and the connect storm
(:mod:`bench.connect_storm`), each run over ``wss://`` against tokend and against the
bare websockets server (``bench/bare_server.py --tls-cert``: the same library and loop,
TLS by the loop's own TLS layer, the context tokend builds), beside the same figures
over plain TCP from the same run (reused when the plain scenarios ran in this
repetition). The certificate is an ECDSA P-256 one made for the run; the clients
(picows) verify it, as real clients do. The clients' ceiling over TLS is the same
clients against the picows server over TLS.

Reported, not judged (no target was set for TLS): tokend over TLS against tokend over
plain TCP, against the bare server over TLS, and the bare server's own TLS cost.
"""

from __future__ import annotations

from typing import Any

from bench import connect_storm, heartbeat
from bench.common import Context, Row, cpu_us_per_op, ratio


def _server_cpu(figures: dict[str, Any]) -> float:
    """The server's CPU per operation, µs (the first process of ``cpu_pct``)."""
    return cpu_us_per_op(next(iter(figures["cpu_pct"].values())), figures["rate"])


def _rows(
    what: str, unit_name: str, tokend: dict[str, Any], plain: dict[str, Any], bare: dict[str, Any]
) -> list[Row]:
    """Three rows for one measure: tokend TLS vs tokend plain, vs bare TLS; bare's cost.
    ``bare`` holds the bare server's figures over TLS (``tls``) and plain TCP (``plain``)."""
    tls_bare, plain_bare = bare["tls"], bare["plain"]
    cpu = (
        f"server CPU/{unit_name}: tokend {_server_cpu(tokend):.0f} µs over TLS, "
        f"{_server_cpu(plain):.0f} µs plain; bare {_server_cpu(tls_bare):.0f} µs over TLS, "
        f"{_server_cpu(plain_bare):.0f} µs plain"
    )
    return [
        Row(
            "tls",
            f"{what}, tokend over TLS vs plain",
            tokend["rate"],
            "/s",
            "(reported)",
            None,
            "tokend plain",
            plain["rate"],
            ratio(tokend["rate"], plain["rate"]),
            cpu,
            {"tokend_tls": tokend, "tokend_plain": plain},
        ),
        Row(
            "tls",
            f"{what} over TLS, tokend vs bare websockets",
            tokend["rate"],
            "/s",
            "(reported)",
            None,
            "bare TLS",
            tls_bare["rate"],
            ratio(tokend["rate"], tls_bare["rate"]),
            "",
            {"bare_tls": tls_bare},
        ),
        Row(
            "tls",
            f"{what}, bare websockets over TLS vs plain",
            tls_bare["rate"],
            "/s",
            "(reported)",
            None,
            "bare plain",
            plain_bare["rate"],
            ratio(tls_bare["rate"], plain_bare["rate"]),
            "",
            {"bare_plain": plain_bare},
        ),
    ]


def _ceiling_note(name: str, ceilings: dict[str, dict[str, Any]], **measured: Any) -> str:
    """The clients' ceiling (the picows server) over each transport, against the
    highest rate measured over it: ``measured`` maps a transport to its figures."""
    parts = []
    for transport, figures in measured.items():
        highest = max(f["rate"] for f in figures)
        ceiling = ceilings[transport]["rate"]
        parts.append(
            f"{transport} {ceiling:,.0f}/s = {ceiling / highest:.2f}x the highest {transport} "
            f"rate ({highest:,.0f}/s)"
        )
    return f"{name}: clients' ceiling (picows server) " + "; ".join(parts)


async def run(ctx: Context) -> list[Row]:
    n, connects = ctx.sizes.connections, ctx.sizes.connects
    beat_ceiling = {
        "TLS": await heartbeat.bare_figures(ctx, "picows", tls=True),
        "plain": await heartbeat.bare_figures(ctx, "picows"),
    }
    beat_bare = {
        "tls": await heartbeat.bare_figures(ctx, tls=True),
        "plain": await heartbeat.bare_figures(ctx),
    }
    beat_tls = await heartbeat.tokend_figures(ctx, tls=True)
    beat_plain = await heartbeat.tokend_figures(ctx)
    storm_ceiling = {
        "TLS": await connect_storm.figures(ctx, "picows", tls=True),
        "plain": await connect_storm.figures(ctx, "picows"),
    }
    storm_bare = {
        "tls": await connect_storm.figures(ctx, "bare", tls=True),
        "plain": await connect_storm.figures(ctx, "bare"),
    }
    storm_tls = await connect_storm.figures(ctx, "tokend", tls=True)
    storm_plain = await connect_storm.figures(ctx, "tokend")
    rows = _rows(f"heartbeat ACKs/s, {n} conns", "ACK", beat_tls, beat_plain, beat_bare)
    rows += _rows(f"sessions opened/s, {connects:,}", "session", storm_tls, storm_plain, storm_bare)
    rows[0].note += " | " + " | ".join(
        [
            heartbeat.describe("tokend TLS", beat_tls),
            heartbeat.describe("bare TLS", beat_bare["tls"]),
            _ceiling_note(
                "heartbeat",
                beat_ceiling,
                TLS=[beat_tls, beat_bare["tls"]],
                plain=[beat_plain, beat_bare["plain"]],
            ),
        ]
    )
    rows[3].note += " | " + " | ".join(
        [
            connect_storm.describe("tokend TLS", storm_tls),
            connect_storm.describe("bare TLS", storm_bare["tls"]),
            _ceiling_note(
                "connect",
                storm_ceiling,
                TLS=[storm_tls, storm_bare["tls"]],
                plain=[storm_plain, storm_bare["plain"]],
            ),
        ]
    )
    return rows
