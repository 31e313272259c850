"""What both ends of an RPC agree on beyond the .proto: the resync marker, keepalive timings, and the conditions the
engines report that the servers map to gRPC status codes.

Light on purpose (no torch, no models, no server): the coordinator, a client, imports it; so do the workers.
"""

from __future__ import annotations

# A FAILED_PRECONDITION whose message starts with this asks the client to repeat the call with the full history.
RESYNC_PREFIX = "resync:"

# Keepalive pings notice a silently dead peer; clients (coordinator/fleet/channel.py) use these values and servers permit
# pings that often, so they never answer them with GOAWAY "too_many_pings".
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_PING_INTERVAL_MS = 5_000  # servers answer pings more frequent than this with GOAWAY; clients may ping this often


class NotReady(Exception):
    """The model is still loading (UNAVAILABLE)."""


class Cancelled(Exception):
    """The client cancelled the call or its deadline passed: stop working on it (CANCELLED)."""
