"""The pipeline: scanning, queueing, transfers, verification, commit, journal."""
