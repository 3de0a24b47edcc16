"""The admin listener: metrics, health, the admin API and the dashboard, on a port of
its own (docs/operations.md).

- :mod:`tokend.admin.listener`: the HTTP/1.1 layer (llhttp through httptools; limits,
  Host check, one log line per request);
- :mod:`tokend.admin.api`: the ``/v1`` handlers;
- :mod:`tokend.admin.event_ring`: the recent events ``GET /v1/events`` pages through;
- :mod:`tokend.admin.server`: :class:`AdminServer`, the routes of one node.
"""

from tokend.admin.server import AdminServer

__all__ = ["AdminServer"]
