"""memsvc.v1: the gRPC API, generated at build time from protos/memsvc/v1 (never edited by hand).

    from memsvc.v1 import memory_manager_service_pb2 as manager_pb, memory_manager_service_pb2_grpc as manager_grpc

Needs grpcio and protobuf only; importing it never loads torch or the native extension. Installed by
the memsvc-api distribution (api/; memsvc depends on it), which holds this folder and nothing else.
"""
