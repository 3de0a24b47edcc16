"""Scenario: what TLS costs (tokend/edge/tls.py), for heartbeats and for new sessions.

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

from collections.abc import Callable
from typing import Any

from bench import connect_storm, heartbeat
from bench.common import Context, Row, cpu_us_per_op, ratio

# Each server's figures over one transport: tokend, the bare websockets server, and
# the picows server (the clients' ceiling).
Figures = dict[str, dict[str, Any]]


async def heartbeat_figures(ctx: Context, tls: bool) -> Figures:
    return {
        "ceiling": await heartbeat.bare_figures(ctx, "picows", tls=tls),
        "bare": await heartbeat.bare_figures(ctx, tls=tls),
        "tokend": await heartbeat.tokend_figures(ctx, tls=tls),
    }


async def storm_figures(ctx: Context, tls: bool) -> Figures:
    servers = {"ceiling": "picows", "bare": "bare", "tokend": "tokend"}
    return {
        name: await connect_storm.figures(ctx, server, tls=tls) for name, server in servers.items()
    }


def _server_cpu(figures: dict[str, Any]) -> float:
    """The server's CPU per operation, µs (the first process of ``cpu_pct``)."""
    return cpu_us_per_op(next(iter(figures["cpu_pct"].values())), figures["rate"])


def _cpu_pair(tls: dict[str, Any], plain: dict[str, Any]) -> str:
    return f"{_server_cpu(tls):.0f} µs over TLS, {_server_cpu(plain):.0f} µs plain"


def _ceiling(transport: str, figures: Figures) -> str:
    """The clients' ceiling over a transport against the highest rate measured over it."""
    highest = max(figures["tokend"]["rate"], figures["bare"]["rate"])
    ceiling = figures["ceiling"]["rate"]
    return (
        f"{transport} {ceiling:,.0f}/s = {ceiling / highest:.2f}x the highest {transport} "
        f"rate ({highest:,.0f}/s)"
    )


def _rows(
    what: str,
    unit: str,
    describe: Callable[[str, dict[str, Any]], str],
    tls: Figures,
    plain: Figures,
) -> list[Row]:
    """Three rows for one measure: tokend over TLS vs plain, tokend vs bare over TLS,
    and the bare server's own TLS cost; the first row's note has the CPU per ``unit``
    of each, and the clients' ceilings."""
    note = " | ".join(
        [
            f"server CPU/{unit}: tokend {_cpu_pair(tls['tokend'], plain['tokend'])}; "
            f"bare {_cpu_pair(tls['bare'], plain['bare'])}",
            describe("tokend TLS", tls["tokend"]),
            describe("bare TLS", tls["bare"]),
            "clients' ceiling (picows server) "
            + "; ".join([_ceiling("TLS", tls), _ceiling("plain", plain)]),
        ]
    )
    compared = [
        ("tokend over TLS vs plain", tls["tokend"], "tokend plain", plain["tokend"]),
        ("over TLS, tokend vs bare websockets", tls["tokend"], "bare TLS", tls["bare"]),
        ("bare websockets over TLS vs plain", tls["bare"], "bare plain", plain["bare"]),
    ]
    return [
        Row(
            "tls",
            f"{what}, {metric}",
            value["rate"],
            "/s",
            "(reported)",
            None,
            baseline_name,
            baseline["rate"],
            ratio(value["rate"], baseline["rate"]),
            note if i == 0 else "",
            {"value": value, "baseline": baseline},
        )
        for i, (metric, value, baseline_name, baseline) in enumerate(compared)
    ]


async def run(ctx: Context) -> list[Row]:
    n, connects = ctx.sizes.connections, ctx.sizes.connects
    rows = _rows(
        f"heartbeat ACKs/s, {n} conns",
        "ACK",
        heartbeat.describe,
        await heartbeat_figures(ctx, tls=True),
        await heartbeat_figures(ctx, tls=False),
    )
    return rows + _rows(
        f"sessions opened/s, {connects:,}",
        "session",
        connect_storm.describe,
        await storm_figures(ctx, tls=True),
        await storm_figures(ctx, tls=False),
    )
