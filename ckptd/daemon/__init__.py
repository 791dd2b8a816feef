"""The daemon's wiring: the service lifecycle, the HTTP surface, destination health and
systemd's notify protocol."""
