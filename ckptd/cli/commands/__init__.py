"""One module per command, as restic's ``cmd_*.go``: each adds its own parser
(``add_parser``) and runs it (``handle``, returning the exit code for what it checked)."""
