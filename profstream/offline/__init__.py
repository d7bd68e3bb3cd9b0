"""Tools over the archive: reading it, replay, export, the post-mortem report and its charts."""
