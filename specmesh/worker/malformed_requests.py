"""Requests whose bytes are not a valid protobuf message are the caller's error: INVALID_ARGUMENT, not the INTERNAL
("Exception deserializing request!") grpcio answers when a method's deserializer raises. The server keeps serving
either way; the status tells the client the fault is in what it sent."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from specmesh.wire.printable import printable


class MalformedRequest:
    """What a request that could not be decoded becomes, so that the method can answer with the reason."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def decode(data: bytes) -> object:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, invalid UTF-8 in a string field, ...: anything the bytes caused
            # The reason may quote the bytes (a string field's invalid UTF-8): printable, or the status itself fails.
            return MalformedRequest(printable(str(e) or type(e).__name__, limit=300))
    return decode


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    """Decodes unary requests itself and answers INVALID_ARGUMENT for bytes that are not the method's message, before
    the method (and any interceptor after this one) runs."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        inner = handler.unary_unary or handler.unary_stream
        method = handler_call_details.method

        def checked(request, context: grpc.ServicerContext):
            if isinstance(request, MalformedRequest):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the request to {printable(method)} is not a valid protobuf message: {request.reason}")
            return inner(request, context)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.unary_stream_rpc_method_handler
        return make(checked, request_deserializer=_tolerant(handler.request_deserializer),
                    response_serializer=handler.response_serializer)
