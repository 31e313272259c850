"""Hypothesis strategies for random and malformed specmesh requests (shared by tests/test_fuzz.py and
scripts/fuzz.py)."""

from __future__ import annotations

import socket

import grpc
from hypothesis import strategies as st

from specmesh.v1 import specmesh_pb2 as pb

INT32 = st.integers(min_value=-2**31, max_value=2**31 - 1)
UINT32 = st.integers(min_value=0, max_value=2**32 - 1)
UINT64 = st.integers(min_value=0, max_value=2**64 - 1)
# Mostly plausible token ids (the tiny models have 320), sometimes anything an int32 can hold.
TOKEN = st.one_of(st.integers(min_value=0, max_value=330), INT32)
TOKENS = st.lists(TOKEN, max_size=40)
# allow_subnormal=False: the servers flush denormals to zero (torch.set_flush_denormal), process-wide.
FLOAT = st.one_of(st.floats(min_value=0, max_value=2, width=32, allow_subnormal=False),
                  st.floats(width=32, allow_subnormal=False))
SESSION_ID = st.one_of(st.sampled_from(["s1", "s2", "fuzz"]),
                       st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
SAMPLING = st.one_of(st.builds(pb.SamplingParams),
                     st.builds(pb.SamplingParams, temperature=FLOAT, top_k=INT32, top_p=FLOAT))
CONTEXT = st.one_of(
    st.builds(pb.ContextSync, base_length=st.just(0), base_hash=st.just(0xCBF29CE484222325), new_tokens=TOKENS),
    st.builds(pb.ContextSync, base_length=UINT64, base_hash=UINT64, new_tokens=TOKENS))
DIST = st.builds(pb.SparseDistribution, token_ids=TOKENS, probs=st.lists(FLOAT, max_size=40))

VERIFY = st.builds(pb.VerifyRequest, session_id=SESSION_ID, context=CONTEXT, draft_tokens=TOKENS,
                   draft_distributions=st.lists(DIST, max_size=6), sampling=SAMPLING, seed=UINT64)
PROPOSE = st.builds(pb.ProposeRequest, session_id=SESSION_ID, context=CONTEXT,
                    num_tokens=st.one_of(st.integers(min_value=0, max_value=40), UINT32), sampling=SAMPLING,
                    seed=UINT64)
END = st.builds(pb.EndSessionRequest, session_id=SESSION_ID)

# What a well-behaved server may answer to arbitrary input; INTERNAL/UNKNOWN would mean a handler crashed and
# DEADLINE_EXCEEDED that it hung.
PROPER = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})


def call(stub_method, request, timeout_s: float = 20.0) -> grpc.StatusCode:
    try:
        stub_method(request, timeout=timeout_s)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def send_garbage(port: int, garbage: bytes, reply_timeout_s: float) -> None:
    """Open a raw TCP connection to a loopback server, send bytes that are not HTTP/2, read what comes back, close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(garbage)
        raw.settimeout(reply_timeout_s)
        try:
            raw.recv(1024)
        except (socket.timeout, ConnectionError):
            pass
