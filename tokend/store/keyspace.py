"""The keyspace: where a session, its shard's deadline set and stream, and the channels live.

Key layout (documented in docs/protocol.md, "Store layout"). A session lives in
one of :data:`SHARDS` shards, chosen from its tid; every key of a shard carries
the hash tag ``{<prefix>:<shard>}``, so a script that touches a session, its
tombstone, the shard's deadline set and the shard's event stream stays in one
Redis Cluster slot:

* ``<prefix>:{<prefix>:<n>}:s:<tid>``  session hash (fields: :data:`SESSION_FIELDS`)
* ``<prefix>:{<prefix>:<n>}:t:<tid>``  tombstone of an ended session, until its exp
* ``<prefix>:{<prefix>:<n>}:due``      deadline set: tid scored by its next transition time
* ``<prefix>:{<prefix>:<n>}:events``   event stream shard
* ``<prefix>:{<prefix>:<n>}:resumed``  Redis time of the shard's last resume of a parked
  session (hello.lua; sweep.lua holds parked sessions while it is recent)
* ``<prefix>:{<prefix>:<n>}:warn``     set of the shard's sessions in WARN
* ``<prefix>:{<prefix>:<n>}:ended``    hash: the shard's ended sessions by tombstone
* ``<prefix>:{<prefix>:nodes}:view:<node>``  a node's latest view, while it runs
* ``<prefix>:{<prefix>:nodes}:history:<node>``  a node's recent history samples
* ``<prefix>:{<prefix>:nodes}:names``  the nodes that wrote the two above
* ``<prefix>:events``  pub/sub channel of the events
* ``<prefix>:ctl:<node>``  pub/sub channel of node-to-node control, one per node
* ``<prefix>:ctl``  pub/sub channel of revocations, heard by every node (tokend.store.revocations)
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

SHARDS = 16

# The session hash's fields, and which hold numbers; the scripts read them by these names
# only (load_session in lua/_prelude.lua). `conn` is the connection holding the session;
# once that connection ended it is moved to `left` (release.lua), so that the session's
# later events still name the node that held it last. `proof` is the digest of the resume
# proof the holding connection's session key makes (tokend.store.sessions.proof_digest):
# never logged, never shown (docs/security.md). `pk` is when a planned close parked the
# session (release.lua), until the first heartbeat after its resume (heartbeat.lua) or
# the end of its hold (sweep.lua).
SESSION_FIELDS = ("sub", "st", "hb", "exp", "iat", "prio", "conn", "since", "pk", "left", "proof")
# A heartbeat reads the first HEARTBEAT_FIELDS of them only, all it needs: on the hottest
# path, one HMGET of fewer values (tests/test_lua_contract.py holds heartbeat.lua to it).
HEARTBEAT_FIELDS = SESSION_FIELDS.index("left")
NUMERIC_FIELDS = frozenset({"hb", "exp", "iat", "prio", "since", "pk"})


@dataclass(frozen=True, slots=True)
class Keyspace:
    prefix: str

    @staticmethod
    def shard_of(tid: str) -> int:
        """A canonical tid string's shard: its last four hex digits (two bytes), mod 16."""
        return int(tid[-4:], 16) % SHARDS

    @classmethod
    def shard(cls, tid: uuid.UUID) -> int:
        return cls.shard_of(str(tid))

    def session_keys_of(self, shard: int, tid: str) -> list[str]:
        hash_prefix, tomb_prefix = self.session_prefixes(shard)
        return [hash_prefix + tid, tomb_prefix + tid]

    def session_prefixes(self, shard: int) -> tuple[str, str]:
        """What a shard's session hash and tombstone keys start with (the tid follows)."""
        tag = self._tag(shard)
        return f"{tag}:s:", f"{tag}:t:"

    def _tag(self, part: int | str) -> str:
        """What every key of a shard (or of the nodes' part) starts with: its hash tag."""
        return f"{self.prefix}:{{{self.prefix}:{part}}}"

    def shard_keys(self, shard: int) -> list[str]:
        """KEYS[1..2] of every script: the shard's deadline set and event stream."""
        tag = self._tag(shard)
        return [f"{tag}:due", f"{tag}:events"]

    def count_keys(self, shard: int) -> tuple[str, str]:
        """The shard's state counts, which the scripts move with the states (count_key in
        lua/_prelude.lua): the set of its sessions in WARN, and the hash of its ended
        sessions by tombstone."""
        tag = self._tag(shard)
        return f"{tag}:warn", f"{tag}:ended"

    def node_keys(self, node: str) -> tuple[str, str]:
        """A node's view (JSON, kept while it runs) and its history (a list of JSON
        samples): one slot for every node, so that one call reads them all."""
        tag = self._tag("nodes")
        return f"{tag}:view:{node}", f"{tag}:history:{node}"

    @property
    def node_names(self) -> str:
        """The set of the nodes whose view or history the store holds."""
        return f"{self._tag('nodes')}:names"

    def session_keys(self, tid: uuid.UUID) -> list[str]:
        return self.session_keys_of(self.shard(tid), str(tid))

    def script_keys(self, tid: uuid.UUID) -> list[str]:
        return self.shard_keys(self.shard(tid)) + self.session_keys(tid)

    def streams(self) -> list[str]:
        return [self.shard_keys(n)[1] for n in range(SHARDS)]

    @property
    def events_channel(self) -> str:
        return f"{self.prefix}:events"

    @property
    def control_prefix(self) -> str:
        """The scripts address a node's control messages to ``<this>:<node>``."""
        return f"{self.prefix}:ctl"

    def control_channel(self, node: str) -> str:
        return f"{self.control_prefix}:{node}"

    @property
    def revocations_channel(self) -> str:
        """end.lua tells every node of a revocation on the control prefix itself (no node)."""
        return self.control_prefix


def node_of(conn: str) -> str:
    """The node of a connection id ``<node>/<counter>`` ("" for none)."""
    return conn.rpartition("/")[0]
