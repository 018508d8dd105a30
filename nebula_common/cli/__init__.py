"""Nebula command-line interface."""
