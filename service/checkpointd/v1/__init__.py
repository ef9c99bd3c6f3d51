"""Generated gRPC code for checkpointd.v1 (scripts/gen_protos.sh); do not edit."""
