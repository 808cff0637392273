"""skyspot: fine-tune LLMs on spot GPUs through SkyPilot managed jobs, losing nothing to preemptions.

Import-light on purpose: the CLI answers `--help`, `recipes` and `render` without
importing torch, DeepSpeed or SkyPilot.
"""

__version__ = "0.1.0"
