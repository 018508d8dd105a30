"""Typed clients for Nebula services, for scripts, the CLI and other services."""
