"""The outbox app's migrations."""
