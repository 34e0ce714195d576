"""pdserve.v1: generated protobuf and gRPC modules (see proto/generate.py)."""
