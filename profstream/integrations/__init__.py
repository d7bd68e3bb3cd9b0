"""Framework integrations, producers of raw events: torch (and `profstream run`), the Hugging
Face and Lightning trainer callbacks, MindSpore, and trace-file ingest. Each module imports
its framework only when it is imported itself."""
