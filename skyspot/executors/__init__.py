"""Executors run a rendered task: `sky` submits it as a SkyPilot managed job, `local` runs it on this machine."""
