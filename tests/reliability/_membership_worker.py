"""A stand-in worker for the rendered torchrun line (test_restart_in_place.py): each start notes its
generation and torchrun's restart count; node 1's first one crashes, node 0's first one waits outside
any collective, so only the rendezvous (a node waiting to join) can make its agent restart it."""

import json
import os
import signal
import sys
import time
from pathlib import Path

run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
node = int(os.environ["SKYPILOT_NODE_RANK"])
generations = run_dir / "generations"
generations.mkdir(parents=True, exist_ok=True)
number = len(list(generations.iterdir()))
(generations / f"{number}-{os.getpid()}.json").write_text(
    json.dumps(
        {
            "generation": number,
            "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
            "ts": time.time(),
            "rank": int(os.environ["RANK"]),
            "group_rank": int(os.environ["GROUP_RANK"]),
        }
    )
)
if number == 0 and node == 1:
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
if number == 0:
    time.sleep(120)  # healthy and in no collective
