"""Jinja2 templates used by `adapter-gen new`."""
