"""A rehearsal's store round trip on the node: write, read back, delete, through the store's own SDK.

    python -m skyspot.trainer.round_trip ROOT NODE_RANK

A rehearsal (`skyspot launch RECIPE --rehearse`, app/rehearse.py) runs this before the trainer on every
node, so "the node reaches its store" is proven with the credentials and network the real run will have,
not inferred from the launching machine. ROOT is the run's root in its store (`s3://…/RUN`, `gs://…`,
`az://…` or a local path; without a store, the run directory). The object is `ROOT/rehearsal/round-trip-node-R`,
a few random bytes, read back and compared, then deleted. One line either way; exit 2 when it fails (no
retry under the rehearsal's job recovery: a broken store is not what a second try mends).
"""

from __future__ import annotations

import os
import sys
import time

ROUND_TRIP_BYTES = 64 * 1024


def round_trip(root: str, node_rank: str) -> str:
    """Write, read back and delete one object; returns the line to print. Raises on any failure."""
    from skyspot.storage import open_store

    store = open_store(root)
    key = f"rehearsal/round-trip-node-{node_rank}"
    data = os.urandom(ROUND_TRIP_BYTES)
    started = time.monotonic()
    store.put_bytes(key, data)
    back = store.get_bytes(key)
    if back != data:
        raise RuntimeError(
            f"read back {0 if back is None else len(back)} bytes that differ from the {len(data)} written"
        )
    store.delete([key])
    if store.exists(key):
        raise RuntimeError("the object is still there after its delete")
    return (
        f"skyspot rehearsal: store round trip ok: wrote, read back and deleted {len(data)} bytes at "
        f"{key} in {time.monotonic() - started:.2f}s"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m skyspot.trainer.round_trip ROOT NODE_RANK", file=sys.stderr)
        return 2
    try:
        print(round_trip(*argv), flush=True)
    except Exception as error:  # any failure is the finding: one line, the rehearsal reports it
        print(
            f"skyspot rehearsal: store round trip failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
