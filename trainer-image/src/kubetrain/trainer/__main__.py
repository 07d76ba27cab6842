"""``python -m kubetrain.trainer``."""

import sys

from kubetrain.trainer.main import main

if __name__ == "__main__":
    sys.exit(main())
