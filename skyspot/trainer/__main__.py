"""`python -m skyspot.trainer RECIPE --run-dir DIR ...` (under torchrun); see loop.py."""

from skyspot.trainer.loop import process_main

raise SystemExit(process_main())
