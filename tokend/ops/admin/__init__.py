"""The admin listener: metrics, health, the admin API and the dashboard, on a port of
its own (docs/operations.md).

- :mod:`tokend.ops.admin.listener`: the HTTP/1.1 layer (llhttp through httptools; limits,
  Host check, one log line per request);
- :mod:`tokend.ops.admin.api`: the ``/v1`` handlers;
- :mod:`tokend.ops.admin.event_ring`: the recent events ``GET /v1/events`` pages through;
- :mod:`tokend.ops.admin.server`: :class:`AdminServer`, the routes of one node.
"""

from tokend.ops.admin.server import AdminServer

__all__ = ["AdminServer"]
