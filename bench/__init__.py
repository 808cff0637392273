"""skyspot's benchmark suite: `python -m bench` (about 15 minutes on 2 cores) or `python -m bench --quick`."""
