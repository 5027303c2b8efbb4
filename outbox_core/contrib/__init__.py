"""Integrations with frameworks (each one an optional extra)."""
