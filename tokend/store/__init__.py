"""Redis, the source of truth for sessions, and the Lua scripts that change it.

Which module owns what:

* :mod:`~tokend.store.redis_client` - the client for a URL (one Redis, Cluster, Sentinel)
  and what differs on a Cluster (slot table, pub/sub, slot groups).
* :mod:`~tokend.store.keyspace` - the key layout: shards, keys, channels, session fields.
* :mod:`~tokend.store.scripts` - the Lua scripts (``lua/``), the constants they share with
  Python, and running them by SHA with a deadline.
* :mod:`~tokend.store.sessions` - the :class:`~tokend.store.sessions.Store`: HELLO and
  heartbeat batches, the sweep, BYE and revocation.
* :mod:`~tokend.store.queries` - read-only queries for the admin API and the CLI.
* :mod:`~tokend.store.unavailable` - Redis not answering: the exception tuple, the errors
  the store raises, the deadline of every call.
* :mod:`~tokend.store.durability` - WAIT for replicas after a change that must survive a
  failover.
* :mod:`~tokend.store.packing` - hiredis command packing for every kind of connection.
"""
