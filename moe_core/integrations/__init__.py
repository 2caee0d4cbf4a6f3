"""Integrations with model libraries. Each submodule imports its library; this package imports none."""
