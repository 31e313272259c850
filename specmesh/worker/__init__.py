"""The gRPC worker server the drafter and the verifier run on: the session store (one KV-cached sequence per
client session, limits, expiry and eviction), the server itself (health, Info, auth and concurrency interceptors,
graceful drain, forwards on the process's main thread), its settings (config.py), the warm-up cost probe (which
takes turns with the other workers' probes on the machine: machine_load.py), what a worker prepares while it serves
nothing (idle_upkeep.py: an ik engine's spare context), how long a cross-session batch waits for more sessions
(batch_window.py, for both roles), what both roles' model engines share (batching_engine.py: the sessions, the queue
of calls batched across sessions, the cost probe and idle upkeep a warm-up starts), the command line every worker
shares, the answer to undecodable request bytes (malformed_requests.py) and the stdin
lifeline that ends a worker with the process that started it (lifeline.py). A role (drafter/, verifier/) plugs in
through one small seam (role.py): it registers its servicer, builds its engine, and names the Info fields only it
has."""
