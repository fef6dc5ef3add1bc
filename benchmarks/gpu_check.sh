#!/usr/bin/env bash
# The GPU checks, for a CUDA machine that has torch and triton installed but no network, in two
# parts that each fit one short device call:
#   kernels  the kernels benchmark (naive, chunked, Triton, Liger; 152k vocabulary) and the
#            `gpu`-marked tests (kernels, weight transport by CUDA IPC, FSDP, hf rollout)
#   engines  Megatron's single-process tests on CUDA and the RL step's stages (gpu_step.py)
# Each part has time limits, so one that hangs leaves the others their time.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR] [kernels|engines|all]   (OUT_DIR default: benchmarks/results)
#
# Python packages the machine lacks travel as wheels in .whl/ (git-ignored), fetched where
# the registry is reachable, for the GPU machine's Python (3.12 here):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
#       -d .whl tensordict==0.15.3 pyvers transformers==5.23.0 peft==0.21.2 megatron-core==0.16.1 \
#       liger-kernel==0.8.5
# tephra itself runs from the source tree. Logs and JSON results go to OUT_DIR.
set -u
out=${1:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tephra-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/tephra-site
fi
PYTHONPATH=$(printf '%s:' "$PWD"/packages/*/src)${PYTHONPATH:-}
export PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"

pytest=(python3 -m pytest -p no:cacheprovider -o addopts= --import-mode=importlib -q -rfE)
part=${2:-all}
if [ "$part" != engines ]; then
    timeout 260 python3 -m tephra.kernels.bench --device cuda --json "$out/gpu_kernels.json" 2>&1 | tee "$out/gpu_kernels.log" | tail -30
    timeout 200 "${pytest[@]}" -m gpu packages/kernels/tests/test_kernels_gpu.py packages/rollout/tests/test_weight_transport.py \
        packages/engine-fsdp/tests/test_engine_fsdp_gpu.py packages/rollout/tests/test_rollout_hf_gpu.py -s 2>&1 \
        | grep -v Warning | tee "$out/gpu_tests.log" | tail -40
fi
if [ "$part" != kernels ]; then
    timeout 110 "${pytest[@]}" packages/engine-megatron/tests/test_megatron_gpu.py packages/engine-megatron/tests/test_megatron_single.py 2>&1 | tee "$out/gpu_megatron.log" | tail -30
    timeout 150 python3 benchmarks/gpu_step.py --out "$out/gpu_step.json" 2>&1 | grep -v Warning | tee "$out/gpu_step.log" | tail -5
fi
