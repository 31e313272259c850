"""The wire contract's generated code: specmesh_pb2 (messages), specmesh_pb2_grpc (the Drafter and Verifier
services' stubs and servicers) and specmesh_pb2.pyi (types), generated from proto/specmesh/v1/specmesh.proto by
scripts/gen_proto.py (`make proto`). Never edited by hand: tests/specmesh/v1/test_proto.py regenerates and compares."""
