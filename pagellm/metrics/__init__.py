"""Statistics, Prometheus metrics and periodic log lines."""
