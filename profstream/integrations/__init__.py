"""Integrations with training frameworks; each module imports its framework only when imported."""
