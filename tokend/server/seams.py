"""The narrow interfaces between a client's connection and its node, each named after
what it stands for and used module-qualified (``seams.Node``, ``seams.SessionLink``).

:class:`SessionLink` is what the node (:mod:`tokend.server.node`: its batchers, its
registry, the sweeper and the control channel) sees of a connection that holds a
session; its one implementation is :class:`tokend.server.link.SessionLink`, and
``tests/test_node_core.py`` stands a fake in its place. :class:`Node` is what a
connection sees of its node; :class:`tokend.server.node.Node` is the one
implementation, and ``tests/test_connection.py`` stands a fake in its place.
:class:`Connection` is a client's connection as the node's drain closes it. So
:mod:`tokend.server.connection` and :mod:`tokend.server.link` import neither
:mod:`tokend.server.node` nor the store, and the node knows no WebSocket: each side of
the store's round trips (HELLO, heartbeats, BYE: docs/protocol.md §4 and §5) is one
method here.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

from tokend.core import session
from tokend.core.protocol import CloseCode
from tokend.core.session import Close, Session
from tokend.core.store_messages import HeartbeatReply, HeartbeatRequest, HelloAnswer, Known
from tokend.metrics import Metrics
from tokend.server.shedding import Shedder


class SessionLink(Protocol):
    """A connection that holds a session, as the node sees it.

    ``session`` is the connection's protocol core; ``heartbeat_request`` the store's
    request for its heartbeats, set by :meth:`Node.attach` at WELCOME.
    """

    session: Session
    heartbeat_request: HeartbeatRequest | None

    def hello_answered(self, answer: HelloAnswer) -> None:
        """The store took the HELLO: WELCOME, or the close its answer implies."""
        ...

    def hello_failed(self, unavailable: bool) -> None:
        """The store could not take the HELLO: unavailable (1013), or a script error (1011)."""
        ...

    def heartbeats_stored(self, answer: HeartbeatReply) -> None:
        """The batch flush stored this connection's heartbeats: their ACKs go out."""
        ...

    def heartbeats_held(self) -> None:
        """The store is unavailable: ACK from what the session knows (stored later)."""
        ...

    def leave(self) -> None:
        """Its node has been off Redis too long: close 1013, for the client to resume on a
        node that reaches Redis (settings.off_redis)."""
        ...

    def replayed(self, answer: HeartbeatReply) -> None:
        """A heartbeat held through an outage was stored at last."""
        ...

    def known(self) -> Known | None:
        """What the connection knows of its session, to restore it with should Redis have
        lost it; None before WELCOME."""
        ...

    def bye_answered(self, confirmed: bool) -> None:
        """The store recorded the BYE; ``confirmed`` False when the replicas did not
        acknowledge it in time (``durable_replicas``)."""
        ...

    def bye_failed(self) -> None:
        """The store could not take the BYE: the session stays, the client is told (1013)."""
        ...

    def warn(self) -> None:
        """The session entered WARN: NOTICE."""
        ...

    def told_to_close(self, code: int | None) -> None:
        """The store (another node's script, a sweep) ends this session."""
        ...

    def close(self, code: CloseCode, reason: str) -> None:
        """Close from outside the client's messages: a failed flush."""
        ...

    def send_close(self, close: Close | None) -> None:
        """Carry out a close the session decided (the planned close, once released)."""
        ...


class Connection(Protocol):
    """A client's connection as the drain closes it: the session link it holds once its
    WebSocket handshake is done (None before), and its close."""

    @property
    def link(self) -> SessionLink | None: ...

    def close(self, code: CloseCode, reason: str) -> None: ...


class Node(session.Node, Protocol):
    """The node, as a connection sees it: ids, the store's round trips, the registry of
    live sessions, load shedding and metrics; and, as its sessions see it
    (:class:`tokend.core.session.Node`), tokens and the per-sub cap."""

    metrics: Metrics
    shedder: Shedder

    def new_conn_id(self) -> str:
        """A connection id, unique across the cluster."""
        ...

    def submit_hello(self, link: SessionLink) -> None:
        """Start or resume the session (its HELLO verified): answered by
        :meth:`SessionLink.hello_answered` or :meth:`SessionLink.hello_failed`."""
        ...

    def forget_hello(self, link: SessionLink) -> None:
        """The HELLO timed out: not sent to the store, if not sent yet."""
        ...

    def submit_heartbeat(self, link: SessionLink) -> None:
        """Store the session's unanswered heartbeats: answered by
        :meth:`SessionLink.heartbeats_stored` or :meth:`SessionLink.heartbeats_held`."""
        ...

    def end(self, link: SessionLink) -> None:
        """BYE: end the session (logout); answered by :meth:`SessionLink.bye_answered` or
        :meth:`SessionLink.bye_failed`."""
        ...

    def attach(self, link: SessionLink) -> None:
        """The link was WELCOMEd: it holds its session on this node now."""
        ...

    def detach(self, link: SessionLink) -> None:
        """The link's connection ended: forgotten, and its session released."""
        ...

    def release(self, link: SessionLink) -> None:
        """The link's session was given to it after it closed: released at once."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as one of the node's tasks (cancelled when it stops)."""
        ...
