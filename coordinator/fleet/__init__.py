"""The fleet: how the coordinator reaches its workers and keeps a generation going when one fails.

    pools.py            pools of workers: health watching, circuit breakers, spreading sessions
    remote_sessions.py  one generation's drafter and verifier sessions: retries, failover, degradation
    resilience.py       deadlines, retries and circuit breakers
    channel.py          what every client of a worker shares: channel options, session ids, history sync
    worker_client.py    one worker's channel, stubs and health, WorkerError
    token_stream.py     a verifier's Decode stream read with a deadline per token
    connect_errors.py   why a worker cannot be reached, in words that name the fix
    local_workers.py    drafter and verifier subprocesses for a command given no addresses
    polling.py          the wait-until loop behind every "wait until SERVING"

It imports the wire contract and the shared modules at the coordinator's root (cancel, stream_flush), never the loop,
the API, serving or an engine (tests/test_import_cycles.py).
"""
