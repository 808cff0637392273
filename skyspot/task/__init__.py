"""A run rendered for an executor: the SkyPilot managed-job task (render.py, RenderedTask) and the
skyspot wheel every node installs (package.py).
"""
