"""What both ends of an RPC agree on beyond the .proto: the rolling history hash a session syncs by, the validation of
every request field, the limits (largest k), the resync marker and keepalive timings, the conversions between the
decoding types and their protobuf messages, channel security (TLS, bearer tokens), and the printable form in which
error messages and log lines echo what a client sent (`printable`). Light on purpose: gRPC and protobuf, no models and
no server, so that the coordinator, a client, can import it."""
