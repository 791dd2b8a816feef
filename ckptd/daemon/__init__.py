"""The daemon's wiring: its build, its lifecycle (service), the notice loop, the tier set,
the HTTP surface, destination health and systemd's notify protocol."""
