"""The use cases, without gRPC: runs, the save pipeline, admission, shared memory, the catalog, retention, restore."""
