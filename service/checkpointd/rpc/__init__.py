"""The gRPC adapter: translates requests and statuses; the work is in `checkpointd.saves`."""
