"""The command line: parsing, one module per command, and the status view."""
