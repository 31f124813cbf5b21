"""The scheduler service."""
