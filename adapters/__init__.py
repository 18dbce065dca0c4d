"""Adapter specs shipped with pipespec (data files; see docs/spec-reference.md)."""
