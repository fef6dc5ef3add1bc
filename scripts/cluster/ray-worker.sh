#!/usr/bin/env bash
# Join a worker node to the Ray cluster whose head is at HEAD:PORT, in the foreground (SIGTERM
# stops it). Fails with a message when the head does not answer within TEPHRA_JOIN_TIMEOUT_S.
#   scripts/cluster/ray-worker.sh 10.0.0.5:6379
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/common.sh"
address=${1:-}
[[ "$address" == *:* ]] || die "usage: ray-worker.sh HEAD:PORT (the head's address, e.g. 10.0.0.5:$TEPHRA_RAY_PORT); got '${address}'"
require_token ray-worker
host=${address%:*}
port=${address##*:}
if ! wait_for_port "$host" "$port"; then
    die "ray-worker: no Ray head answered at $address within TEPHRA_JOIN_TIMEOUT_S=$TEPHRA_JOIN_TIMEOUT_S s; start scripts/cluster/ray-head.sh on $host first, check the host, the port (TEPHRA_RAY_PORT) and the firewall, or raise TEPHRA_JOIN_TIMEOUT_S"
fi
args=(--address="$address")
node_args args
echo "ray-worker: joining the head at $address" >&2
exec "$RAY" start "${args[@]}" --block
