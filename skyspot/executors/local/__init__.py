"""The embedded local executor (docs/local.md): start, cancel, resume (executor.py, its EXECUTOR),
the controller and its deadline, the follower, fresh nodes, spot traces, the metadata stand-in.
"""
