"""The SkyPilot executor: its side of the surface (executor.py, its EXECUTOR) over the SDK
(sdk.py), submit and resume (submit.py) and the deadline's controller (deadline.py), which
never import it. The only package that imports `sky`.
"""
