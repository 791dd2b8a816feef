"""The read side of the store: the repository (every key), verify, retention, tiers and
restore."""
