"""Compatibility matrix: runs the conformance suites per database (see its issue)."""
