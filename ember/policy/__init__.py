"""The gate before remote compute: which datasets may go where (registry.py), where jobs may go
and what they may spend there (targets.py), and one pure function that decides (gate.py)."""
