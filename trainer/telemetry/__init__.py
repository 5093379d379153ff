"""Trainer telemetry: metrics, MFU, Prometheus targets and the step stream."""
