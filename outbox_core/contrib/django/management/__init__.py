"""Django's discovery package."""
