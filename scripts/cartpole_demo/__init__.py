"""The demo behind scripts/demo.sh: its trainer, processes and fleet mode."""
