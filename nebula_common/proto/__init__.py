"""Generated gRPC stubs (see tools/gen_proto.py)."""
