# Settings shared by the cluster scripts (sourced, not run). Each is an environment variable
# with a default; the README's "Running on a cluster" lists them.

RAY=${RAY:-ray}                                  # the ray CLI of the environment tephra runs in
PYTHON=${PYTHON:-python}                         # the Python of that environment
TEPHRA_RAY_PORT=${TEPHRA_RAY_PORT:-6379}         # the head's GCS port: the address is HEAD:PORT
TEPHRA_CLIENT_PORT=${TEPHRA_CLIENT_PORT:-10001}  # Ray client server on the head (ray://HEAD:PORT)
TEPHRA_NUM_CPUS=${TEPHRA_NUM_CPUS:-}             # CPUs this node offers (empty: all Ray detects)
TEPHRA_NUM_GPUS=${TEPHRA_NUM_GPUS:-}             # GPUs this node offers (empty: all visible)
TEPHRA_OBJECT_STORE_BYTES=${TEPHRA_OBJECT_STORE_BYTES:-}  # object store (empty: Ray's 30% of RAM)
TEPHRA_NODE_IP=${TEPHRA_NODE_IP:-}               # this node's address (empty: Ray picks one)
TEPHRA_RAY_TEMP_DIR=${TEPHRA_RAY_TEMP_DIR:-}     # Ray's session folder (empty: /tmp/ray)
TEPHRA_JOIN_TIMEOUT_S=${TEPHRA_JOIN_TIMEOUT_S:-300}  # how long a node waits for the head, and
                                                     # the head for every node, before failing

die() {
    echo "$*" >&2
    exit 1
}

# Ray's token authentication: every node and the trainer's driver must hold the same token.
# Without one, anyone who reaches the ports can run code on the cluster (Ray's servers listen
# on every interface), so the scripts refuse to start unless the user says so.
require_token() {
    local who=$1
    export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
    if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
        if [ -z "${RAY_AUTH_TOKEN_PATH:-}" ] || [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
            die "$who: Ray token authentication is on but no token is set: export RAY_AUTH_TOKEN (the same on every node and for the trainer, e.g. \$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')) or RAY_AUTH_TOKEN_PATH (a file only you can read, on a shared filesystem); RAY_AUTH_MODE=disabled runs without (anyone who reaches the ports can then run code)"
        fi
    fi
}

# The arguments of `ray start` that describe this node: resources, object store, address.
node_args() {
    local -n out=$1
    out+=(--disable-usage-stats)
    [ -n "$TEPHRA_NUM_CPUS" ] && out+=(--num-cpus="$TEPHRA_NUM_CPUS")
    [ -n "$TEPHRA_NUM_GPUS" ] && out+=(--num-gpus="$TEPHRA_NUM_GPUS")
    [ -n "$TEPHRA_OBJECT_STORE_BYTES" ] && out+=(--object-store-memory="$TEPHRA_OBJECT_STORE_BYTES")
    [ -n "$TEPHRA_NODE_IP" ] && out+=(--node-ip-address="$TEPHRA_NODE_IP")
    [ -n "$TEPHRA_RAY_TEMP_DIR" ] && out+=(--temp-dir="$TEPHRA_RAY_TEMP_DIR")
    # the workers are the training: same priority as the rest (Ray starts them at niceness 15)
    export RAY_worker_niceness=${RAY_worker_niceness:-0}
    return 0
}

# Wait until something answers on host:port, at most TEPHRA_JOIN_TIMEOUT_S seconds.
wait_for_port() {
    # Nanoseconds, not bash's SECONDS: SECONDS ticks on whole seconds since the shell started,
    # so a deadline taken from it can come up to a second early.
    local host=$1 port=$2 start
    start=$(date +%s%N)
    until timeout 2 bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null; do
        (( $(date +%s%N) - start >= TEPHRA_JOIN_TIMEOUT_S * 1000000000 )) && return 1
        sleep 1
    done
}
