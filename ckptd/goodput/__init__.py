"""Goodput: the run ledger (what each interval of the run was spent on, kept in the store)
and what it adds up to."""
