"""The seam between the worker server and a role (drafter/, verifier/).

The server owns everything roles share: the port, health, auth, Info and EndSession, metrics, draining. A role says
what it serves (WorkerRole): it registers its servicer and builds its engine, and names the Info fields only it has.
Its engine (WorkerEngine) tells the server what it runs (ModelDescription), holds the sessions, warms up and forgets
sessions. What a role's servicer reads of the server it is registered on is WorkerHost, which the server
(specmesh/worker/server.py's WorkerServer) implements: this module never imports the server, the server imports it.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from specmesh.runtime.engine import ModelEngine
from specmesh.worker.config import FaultInjection, ServerConfig
from specmesh.worker.session_store import SessionStore

if TYPE_CHECKING:
    import grpc


@dataclass(frozen=True)
class ModelDescription:
    """What a worker reports about what it runs (Info and its log), whether a model engine or a tokenizer alone."""

    name: str  # the model spec
    vocab_size: int  # logits width: the token ids a request may carry
    fingerprint: str  # of the tokenizer: a drafter and a verifier must agree on it
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    context_limit: int | None  # longest history one session may hold; None: no limit of its own
    engine: str = ""  # the model runtime; "" when no model runs
    weights_bytes: int = 0
    linear_backend: str = ""  # CPU linear layers ("onednn", "torch"); "" when the runtime has none to choose
    deterministic: bool = True  # answers independent of the load (no model: nothing to vary)
    build: str = ""  # which build of the engine runs and how (ik: package, vector extensions, repack); "" if unsaid

    @classmethod
    def of(cls, engine: ModelEngine) -> "ModelDescription":
        return cls(name=engine.name, vocab_size=engine.vocab_size, fingerprint=engine.fingerprint,
                   eos_token_ids=tuple(engine.eos_token_ids), device=engine.device, dtype=engine.dtype,
                   context_limit=engine.context_limit, engine=engine.engine, weights_bytes=engine.weights_bytes,
                   linear_backend=engine.linear_backend, deterministic=engine.deterministic,
                   build=getattr(engine, "build", ""))


class WorkerEngine(Protocol):
    """What the server needs of any role's engine."""

    description: ModelDescription
    sessions: SessionStore  # counted and sized for Info and the metrics

    def warm_up(self) -> None:
        """Run the first (slow) calls before the worker reports SERVING. What the role's Info reports of its costs is
        set here when cached, else measured on a thread of the engine's own after warm-up (specmesh/worker/
        cost_probe.py): engines that start one have stop_background_work(), which ends it."""

    def end_session(self, session_id: str) -> bool:
        """Forget a session; False when it was not held."""


class WorkerHost(Protocol):
    """What a role's servicer reads of the worker server it is registered on (WorkerServer implements it)."""

    role: "WorkerRole"
    config: ServerConfig
    faults: FaultInjection
    engine: WorkerEngine | None  # None until the model has loaded
    max_context_length: int  # longest history a session may hold: the configured limit within the model's
    stopping: threading.Event  # set once the server has begun to stop

    def call_in_flight(self) -> AbstractContextManager[None]:
        """Counts a servicer call while it runs, so that stopping waits for it."""


class WorkerRole(Protocol):
    """What a role brings to the server."""

    name: str  # "drafter" or "verifier": logs, metrics labels
    service_name: str  # the gRPC service that health reports on

    def add_servicer(self, worker: WorkerHost, server: "grpc.Server") -> None:
        """Register the role's servicer (its RPCs, Info and EndSession) on `server`."""

    def build_engine(self, config: ServerConfig) -> WorkerEngine:
        """Load what the role runs (weights, or a tokenizer alone) and build its engine; not warmed up yet."""

    def info_fields(self, engine: WorkerEngine) -> dict[str, float]:
        """The Info fields only this role has (its measured costs), by InfoResponse field name."""
