"""``python -m kubetrain.trainer``."""

import logging
import os
import sys

from kubetrain.trainer.main import main

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    # torch 2.13's gloo can abort in interpreter teardown after a clean destroy_process_group when the peers
    # exit at the same moment ("terminate called without an active exception", exit 134), turning a finished
    # rank into a failed one. The trainer has closed its files, writers and reporter by now: leave without it.
    os._exit(code)
