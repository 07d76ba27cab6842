"""`python -m kubetrain.operator`: run the operator (one replica, or several with --leader-elect)."""

import argparse
import asyncio
import logging
import os

import kopf

from kubetrain.operator import handlers  # noqa: F401 - registers the handlers


def main() -> None:
    p = argparse.ArgumentParser(prog="kubetrain-operator")
    p.add_argument("--namespace", default=os.environ.get("KUBETRAIN_NAMESPACE"), help="watch one namespace only")
    p.add_argument("--leader-elect", action="store_true",
                   help="several replicas: only the holder of a coordination.k8s.io Lease reconciles, the others "
                        "keep warm caches and take over when it goes")
    p.add_argument("--leader-elect-lease", default="kubetrain-operator", help="the Lease's name")
    p.add_argument("--leader-elect-namespace",
                   default=os.environ.get("POD_NAMESPACE") or os.environ.get("KUBETRAIN_NAMESPACE") or "default",
                   help="the Lease's namespace (default: $POD_NAMESPACE, else the watched namespace, else default)")
    p.add_argument("--liveness", default=os.environ.get("KUBETRAIN_LIVENESS", "http://0.0.0.0:8081/healthz"),
                   help="kopf's health endpoint")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args()
    kopf.configure(verbose=args.verbose)  # kopf's log format and levels (INFO; DEBUG with --verbose)
    if not args.verbose:  # kopf logs every handler call on its objects at INFO: thousands of lines per gang
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.namespace:
        os.environ["KUBETRAIN_NAMESPACE"] = args.namespace
    if args.leader_elect:
        os.environ["KUBETRAIN_LEADER_ELECT"] = f"{args.leader_elect_namespace}/{args.leader_elect_lease}"
    # kopf only feeds the caches (event handlers, nothing written by kopf), so every replica runs it
    # standalone; the Lease decides who acts.
    asyncio.run(kopf.operator(
        clusterwide=args.namespace is None,
        namespaces=[args.namespace] if args.namespace else (),
        standalone=True,
        liveness_endpoint=args.liveness,
    ))


if __name__ == "__main__":
    main()
