"""How the client reaches its daemon: one session under every saver, its channels and outages, the streams of a save and a restore, and same-host shared-memory segments."""
