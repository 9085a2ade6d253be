"""Benchmarks: each `python -m bench.<name> --out FILE.json` prints a table and writes its figures."""
