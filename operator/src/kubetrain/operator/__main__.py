"""`python -m kubetrain.operator`: run the operator (standalone, or with kopf peering for replicas)."""

import argparse
import asyncio
import logging
import os
import random

import kopf

from kubetrain.operator import handlers  # noqa: F401 - registers the handlers


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def main() -> None:
    p = argparse.ArgumentParser(prog="kubetrain-operator")
    p.add_argument("--namespace", default=os.environ.get("KUBETRAIN_NAMESPACE"), help="watch one namespace only")
    p.add_argument("--peering", default=os.environ.get("KUBETRAIN_PEERING"),
                   help="kopf peering name: replicas elect one active instance (needs kopf's peering CRDs)")
    p.add_argument("--priority", type=int, default=_env_int("KUBETRAIN_PRIORITY"),
                   help="kopf peering priority: the highest running peer is active, the others stand by "
                        "(default: random per process, so identical replicas never tie)")
    p.add_argument("--liveness", default=os.environ.get("KUBETRAIN_LIVENESS", "http://0.0.0.0:8081/healthz"))
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args()
    if args.priority is None:
        args.priority = random.SystemRandom().randint(1, 2**31 - 1)
    kopf.configure(verbose=args.verbose)  # kopf's log format and levels (INFO; DEBUG with --verbose)
    if not args.verbose:  # kopf logs every handler call on its objects at INFO: thousands of lines per gang
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.peering:
        logging.getLogger("kubetrain.operator").info("peering %r with priority %d", args.peering, args.priority)
    if args.namespace:
        os.environ["KUBETRAIN_NAMESPACE"] = args.namespace
    asyncio.run(kopf.operator(
        clusterwide=args.namespace is None,
        namespaces=[args.namespace] if args.namespace else (),
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness,
    ))


if __name__ == "__main__":
    main()
