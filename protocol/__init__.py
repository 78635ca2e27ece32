"""The client-facing wire protocol, shared by the ingest processes, the broker's front door and clients."""
