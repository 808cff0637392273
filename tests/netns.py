"""The hosts harness lives in the package (the local executor's --netns uses it): skyspot/executors/local/netns.py."""

from skyspot.executors.local.netns import *  # noqa: F401,F403
