"""Run a Hugging Face Trainer script unchanged (a user's, with no kubetrain import) and kill this rank once.

    python hf_fail_once.py SCRIPT [ARGS...]

The drill `kubetrain run --fail-at R:S` gives kubetrain's trainer and KubetrainCallback, for a script that
knows nothing of kubetrain: with KUBETRAIN_FAIL_AT=R:S in generation 0, rank R exits 137 right after optimizer
step S. Every Trainer the script builds gets the callback that does it; the script itself runs as __main__.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

import transformers


class FailOnce(transformers.TrainerCallback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step and int(os.environ.get("RANK", "0")) == self.rank:
            print(f"hf_fail_once: rank {self.rank} exits after step {self.step}", file=sys.stderr, flush=True)
            os._exit(137)


def main() -> None:
    raw = os.environ.get("KUBETRAIN_FAIL_AT", "")
    if raw and os.environ.get("KUBETRAIN_RESTART_GENERATION", "0") == "0":
        rank, step = (int(v) for v in raw.split(":"))
        init = transformers.Trainer.__init__

        def with_failure(self: transformers.Trainer, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.add_callback(FailOnce(rank, step))

        transformers.Trainer.__init__ = with_failure  # type: ignore[method-assign]
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
