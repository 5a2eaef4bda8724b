"""Eviction policies: trace replays, generated traffic, the end-to-end server runs."""
