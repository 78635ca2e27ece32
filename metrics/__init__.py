"""Service metrics: every process publishes snapshots of its own figures (`registry`), one collector
per instance aggregates them with per-process resource figures (`collector`). `gcwatch`,
`allocwatch` and `stallwatch` watch a serving process's own health: its collector's pauses, what
it keeps allocated, and whether its loop still turns.

This package's import stays light on purpose: `metrics.registry` is imported by every process's hot
path, so nothing here pulls in psutil or prometheus_client.
"""
