"""The gRPC worker server the drafter and the verifier both run on: the session store (one KV-cached sequence per
client session, limits, expiry and eviction), the server itself (health, Info, auth and concurrency interceptors,
graceful drain, forwards on the process's main thread) and the command line every worker shares. Each role brings
its own engine and servicer (drafter/, verifier/)."""
