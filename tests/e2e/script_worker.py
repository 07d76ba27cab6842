"""A user's own training script in custom-command mode (spec.command), used by the
local-backend tests: it follows the worker contract with no torch at all.

Every rank counts steps; rank 0 writes progress.json. A completed step is
"checkpointed" every CKPT_EVERY steps by writing a committed step dir, and a
restarted generation resumes from the newest one. It honours KUBETRAIN_FAIL_AT
and exits with SCRIPT_EXIT_CODE at SCRIPT_EXIT_STEP when those are set.
"""

import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from kubetrain.core import contract
from kubetrain.core.progress import (
    COMMIT_MARKER,
    CheckpointRecord,
    Progress,
    checkpoint_dirname,
    latest_checkpoint,
    read_progress,
    write_progress,
)

rank = int(os.environ[contract.RANK])
out = Path(os.environ[contract.OUTPUT_DIR])
ckpt = Path(os.environ[contract.CHECKPOINT_DIR])
gen = int(os.environ[contract.RESTART_GENERATION])
max_steps = int(os.environ.get("SCRIPT_MAX_STEPS", "12"))
every = int(os.environ.get("SCRIPT_CKPT_EVERY", "4"))
fail_rank, fail_step = (int(x) for x in os.environ.get(contract.FAIL_AT, "-1:-1").split(":"))
exit_step = int(os.environ.get("SCRIPT_EXIT_STEP", "-1"))

latest = latest_checkpoint(ckpt)
step = latest[0] if latest else 0
prev = read_progress(out) or Progress()
checkpoints = list(prev.checkpoints)
while step < max_steps:
    time.sleep(0.05)
    step += 1
    if rank == fail_rank and step == fail_step:
        os._exit(contract.FAIL_AT_EXIT_CODE)
    if step == exit_step and rank == 0:
        sys.exit(int(os.environ["SCRIPT_EXIT_CODE"]))
    record = None
    if rank == 0 and (step % every == 0 or step == max_steps):
        d = ckpt / checkpoint_dirname(step)
        d.mkdir(parents=True, exist_ok=True)
        (d / COMMIT_MARKER).write_text("ok")
        checkpoints.append(step)
        record = CheckpointRecord(step=step, path=str(d), time=datetime.now(UTC).isoformat())
    if rank == 0:
        write_progress(out, Progress(
            job=os.environ[contract.JOB], generation=gen, step=step, max_steps=max_steps,
            loss=10.0 / step, initial_loss=prev.initial_loss or 10.0, tokens_per_second=100.0,
            world_size=int(os.environ[contract.WORLD_SIZE]), checkpoints=checkpoints,
            last_checkpoint=record or prev.last_checkpoint, finished=step == max_steps,
            time=datetime.now(UTC).isoformat(),
        ))
sys.exit(0)
