"""Conversions between the decoding types and their protobuf messages, for both ends of an RPC.

Requests a server receives are checked field by field on the way in (`validation`); these conversions are the trusted
direction: what a process builds itself, or what its own peer answered.
"""

from __future__ import annotations

from collections.abc import Iterable

from specmesh.decoding.sampling import SamplingParams, SparseDist
from specmesh.v1 import specmesh_pb2 as pb


def sampling_to_wire(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


def dists_to_wire(dists: Iterable[SparseDist]) -> list[pb.SparseDistribution]:
    return [pb.SparseDistribution(token_ids=list(d.token_ids), probs=list(d.probs)) for d in dists]


def dists_from_wire(dists: Iterable[pb.SparseDistribution]) -> tuple[SparseDist, ...]:
    return tuple(SparseDist(tuple(d.token_ids), tuple(d.probs)) for d in dists)
