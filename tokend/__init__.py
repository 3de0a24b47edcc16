"""tokend: a WebSocket session server for short-lived signed tokens."""

__version__ = "0.1.0"
