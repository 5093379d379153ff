"""Prometheus alerting rules: see alerts/build.py."""
