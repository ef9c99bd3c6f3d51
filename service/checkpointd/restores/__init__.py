"""The restore use cases without gRPC: a committed save's values (Restore), its files as they are
(RestoreFiles), and those files staged on the daemon's host for a client there."""
