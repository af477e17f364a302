"""Training and evaluation engine."""
