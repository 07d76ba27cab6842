"""`python -m kubetrain.operator`: run the operator (one replica, or several with --leader-elect)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence

import kopf

from kubetrain.operator.handlers import OperatorMemo  # importing it registers the handlers
from kubetrain.operator.runtime.settings import parse_settings


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv, os.environ)
    kopf.configure(verbose=settings.verbose)  # kopf's log format and levels (INFO; DEBUG with --verbose)
    if not settings.verbose:  # kopf logs every handler call on its objects at INFO: thousands of lines per gang
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # kopf only feeds the caches (event handlers, nothing written by kopf), so every replica runs it
    # standalone; the Lease decides who acts.
    asyncio.run(kopf.operator(
        clusterwide=not settings.namespaces,
        namespaces=list(settings.namespaces),
        standalone=True,
        liveness_endpoint=settings.liveness,
        memo=OperatorMemo(settings),
    ))


if __name__ == "__main__":
    main()
