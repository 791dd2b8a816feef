"""Many nodes, one checkpoint: the pure protocol (announcements, parts, their merge) and
the assembly of the global commit."""
