"""Checkpoint cadence: the pure model (how often to save) and the advisor that measures
and publishes it."""
