"""How a snapshot's bytes reach the daemon besides the gRPC stream: the same-host shared-memory segments."""
