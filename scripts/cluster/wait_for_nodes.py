"""Wait until a Ray cluster has the expected number of live nodes, or fail with a message.

    python scripts/cluster/wait_for_nodes.py HEAD:PORT NODES [--timeout-s S]

Run on any machine that reaches the head, before starting the trainer: a node that did not
join would otherwise show up much later as a placement group that cannot be granted. It asks
the head's GCS directly (what `ray status` asks, without its 10+ s of start-up per call);
the token comes from RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH as for every Ray client.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any

# the scripts' default, as for the nodes; Ray reads the mode once, when it is imported
os.environ.setdefault("RAY_AUTH_MODE", "token")

from ray._raylet import GcsClient  # noqa: E402
from ray.core.generated.gcs_pb2 import GcsNodeInfo  # noqa: E402
from ray.exceptions import AuthenticationError  # noqa: E402


def head_answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return False
    return True


def live_nodes(client: GcsClient) -> list[GcsNodeInfo]:
    infos = client.get_all_node_info(timeout=10, state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
    return list(infos.values())


def describe(nodes: list[GcsNodeInfo]) -> str:
    parts = []
    for node in nodes:
        total = dict(node.resources_total)
        parts.append(
            f"{node.node_manager_address} (CPU {total.get('CPU', 0):g}, GPU {total.get('GPU', 0):g})"
        )
    return ", ".join(parts) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", help="the head's HOST:PORT")
    parser.add_argument("nodes", type=int, help="nodes the cluster must have, the head included")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=float(os.environ.get("TEPHRA_JOIN_TIMEOUT_S", "300")),
        help="seconds to wait (default: TEPHRA_JOIN_TIMEOUT_S, else 300)",
    )
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.timeout_s
    while not head_answers(args.address):
        if time.monotonic() >= deadline:
            print(
                f"wait_for_nodes: no Ray head answered at {args.address} within "
                f"{args.timeout_s:g} s; start scripts/cluster/ray-head.sh there, or check the "
                "address and the firewall",
                file=sys.stderr,
            )
            return 1
        time.sleep(1)
    client: Any = None
    nodes: list[GcsNodeInfo] = []
    while True:
        try:
            client = client or GcsClient(address=args.address)
            nodes = live_nodes(client)
        except AuthenticationError:
            print(
                f"wait_for_nodes: the Ray head at {args.address} refused this token; export "
                "the RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) the nodes were started with",
                file=sys.stderr,
            )
            return 1
        except Exception as exc:  # noqa: BLE001  (the GCS may still be starting: retried)
            error = exc
        else:
            error = None
            if len(nodes) >= args.nodes:
                print(f"wait_for_nodes: {len(nodes)} nodes joined: {describe(nodes)}", flush=True)
                return 0
        if time.monotonic() >= deadline:
            why = f" (last error: {error})" if error is not None else ""
            print(
                f"wait_for_nodes: {len(nodes)} of {args.nodes} nodes joined the Ray cluster at "
                f"{args.address} within {args.timeout_s:g} s{why}; joined: {describe(nodes)}. "
                "Look at the missing nodes' ray-worker.sh output (wrong head address, another "
                "RAY_AUTH_TOKEN, a firewall), or raise TEPHRA_JOIN_TIMEOUT_S",
                file=sys.stderr,
            )
            return 1
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
