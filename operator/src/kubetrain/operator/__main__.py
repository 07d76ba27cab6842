"""`python -m kubetrain.operator`: run the operator (standalone, or with kopf peering for replicas)."""

import argparse
import asyncio
import os

import kopf

from kubetrain.operator import handlers  # noqa: F401 - registers the handlers


def main() -> None:
    p = argparse.ArgumentParser(prog="kubetrain-operator")
    p.add_argument("--namespace", default=os.environ.get("KUBETRAIN_NAMESPACE"), help="watch one namespace only")
    p.add_argument("--peering", default=os.environ.get("KUBETRAIN_PEERING"),
                   help="kopf peering name: replicas elect one active instance (needs kopf's peering CRDs)")
    p.add_argument("--liveness", default=os.environ.get("KUBETRAIN_LIVENESS", "http://0.0.0.0:8081/healthz"))
    args = p.parse_args()
    if args.namespace:
        os.environ["KUBETRAIN_NAMESPACE"] = args.namespace
    asyncio.run(kopf.operator(
        clusterwide=args.namespace is None,
        namespaces=[args.namespace] if args.namespace else (),
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
    ))


if __name__ == "__main__":
    main()
