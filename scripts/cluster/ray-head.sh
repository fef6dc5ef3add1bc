#!/usr/bin/env bash
# Start the head node of a Ray cluster for tephra, in the foreground (SIGTERM or Ctrl-C stops
# it and every Ray process it started). Settings: scripts/cluster/common.sh.
#   scripts/cluster/ray-head.sh            then, on each other node:
#   scripts/cluster/ray-worker.sh HEAD:6379
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/common.sh"
require_token ray-head
# no dashboard unless asked for (TEPHRA_DASHBOARD=true): the trainer needs none
args=(--head --port="$TEPHRA_RAY_PORT" --ray-client-server-port="$TEPHRA_CLIENT_PORT"
    --include-dashboard="${TEPHRA_DASHBOARD:-false}")
node_args args
echo "ray-head: starting the head on port $TEPHRA_RAY_PORT (auth: $RAY_AUTH_MODE); workers join with scripts/cluster/ray-worker.sh HEAD:$TEPHRA_RAY_PORT" >&2
exec "$RAY" start "${args[@]}" --block
