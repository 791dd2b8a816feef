"""Reliability campaigns: a fault repeated at many seeded random instants, then an
independent check, and a table of what happened (docs/guarantees.md, "Campaigns").

``test_campaigns.py`` runs the short versions under pytest (marker ``campaign``);
``python -m tests.campaigns`` runs the long ones.
"""
