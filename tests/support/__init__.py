"""Helpers shared by tests: real services in-process, fixtures that several test modules need."""
