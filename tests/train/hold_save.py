"""``python tests/train/hold_save.py STEP ARGS...``: ``mha2mla ARGS...`` held inside its checkpoint save at ``STEP``,
after the trainable weights and the optimizer state are written and before the rest: a file HELD marks the staging
folder and the process sleeps there, so a test can kill -9 it half-way through a save
(tests/cli/test_reliability.py)."""

from __future__ import annotations

import sys
import time

from mha2mla.cli.main import main
from mha2mla.train.state import checkpoint

HELD = "HELD"


def hold_at(step: int) -> None:
    """Wrap the checkpoint's file writer: the save of ``step`` stops as it comes to the scheduler's file."""
    write = checkpoint._write_synced

    def held(path, contents) -> None:
        if path.name == checkpoint.SCHEDULER_FILE and f"step-{step:06d}" in path.parent.name:
            (path.parent / HELD).write_text("held inside save_checkpoint\n")
            time.sleep(3600)
        write(path, contents)

    checkpoint._write_synced = held


if __name__ == "__main__":
    hold_at(int(sys.argv[1]))
    sys.argv = ["mha2mla", *sys.argv[2:]]
    main()
