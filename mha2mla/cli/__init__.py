"""Thin Typer layer: each command module parses options and calls the library."""
