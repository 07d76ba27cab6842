import sys

from kubetrain.core.cli import main

sys.exit(main())
