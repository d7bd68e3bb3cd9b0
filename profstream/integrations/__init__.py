"""Framework integrations: torch, launch, MindSpore and trace-file ingest, producers of raw events."""
