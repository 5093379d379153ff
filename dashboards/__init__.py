"""Grafana dashboards as code: see dashboards/build.py."""
