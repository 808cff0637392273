"""skyspot's benchmark suite: `python -m bench` (everything) or `python -m bench --quick` (five of the eleven, shortened; docs/benchmarks.md, Quick mode)."""
