#!/usr/bin/env bash
# The GPU checks, for a CUDA machine that has torch and triton installed but no network, in
# parts that each fit one short device call:
#   kernels         the kernels benchmark (naive, chunked, Triton, Liger; 152k vocabulary) and the
#                   `gpu`-marked tests (kernels, weight transport by CUDA IPC, FSDP, hf rollout)
#   engines         Megatron's single-process tests on CUDA and the RL step's stages (gpu_step.py)
#   throughput 16k  trainer_throughput.py: Qwen3-0.6B at 16k tokens/step (+ the attention kernels
#                   alone) and Qwen3-4B LoRA 16 at 16k -> OUT_DIR/trainer_throughput_16k.json
#   throughput 64k  Qwen3-0.6B at 64k tokens/step (+ attention kernels) -> ..._64k.json
#   stage N         copies part N of Ray's wheel (carried in .whl/ray/part-N) to /tmp
#   ray             joins Ray's staged parts, installs Ray, runs gpu_ray.py (apps/ppo's smoke
#                   preset under Ray on CUDA) -> OUT_DIR/gpu_ray.json
# Each part has time limits, so one that hangs leaves the others their time. The order of
# device calls that fits 15 minutes of device time: benchmarks/README.md, "A device session".
#
#   bash benchmarks/gpu_check.sh [OUT_DIR] [kernels|engines|all|throughput 16k|throughput 64k|stage N|ray]
#   (OUT_DIR default: benchmarks/results; `all` is kernels + engines)
#
# Python packages the machine lacks travel as wheels in .whl/ (git-ignored), fetched where
# the registry is reachable, for the GPU machine's Python (3.12 here):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
#       -d .whl tensordict==0.15.3 pyvers transformers==5.23.0 peft==0.21.2 megatron-core==0.16.1 \
#       liger-kernel==0.8.5
# Ray and its dependencies travel in parts: benchmarks/stage_wheels.sh (download, carry, stage,
# join). tephra itself runs from the source tree. Logs and JSON results go to OUT_DIR.
set -u
out=${1:-benchmarks/results}
part=${2:-all}
arg=${3:-}
case "$part/$arg" in
kernels/ | engines/ | all/ | throughput/16k | throughput/64k | ray/ | stage/[1-9]) ;;
*) echo "unknown part '$part $arg': kernels, engines, all, throughput 16k|64k, stage N, ray" >&2; exit 2 ;;
esac
if [ "$part" = stage ]; then  # nothing else: the part travels while another part runs
    exec bash benchmarks/stage_wheels.sh stage "$arg"
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tephra-site .whl/*.whl || exit 1
fi
if [ -d /tmp/tephra-site ]; then  # installed by this call or an earlier one of the warm machine
    export PYTHONPATH=/tmp/tephra-site
fi
PYTHONPATH=$(printf '%s:' "$PWD"/packages/*/src)${PYTHONPATH:-}
export PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"

pytest=(python3 -m pytest -p no:cacheprovider -o addopts= --import-mode=importlib -q -rfE)
if [ "$part" = kernels ] || [ "$part" = all ]; then
    timeout 260 python3 -m tephra.kernels.bench --device cuda --json "$out/gpu_kernels.json" 2>&1 | tee "$out/gpu_kernels.log" | tail -30
    timeout 200 "${pytest[@]}" -m gpu packages/kernels/tests/test_kernels_gpu.py packages/rollout/tests/test_weight_transport.py \
        packages/engine-fsdp/tests/test_engine_fsdp_gpu.py packages/rollout/tests/test_rollout_hf_gpu.py -s 2>&1 \
        | grep -v Warning | tee "$out/gpu_tests.log" | tail -40
fi
if [ "$part" = engines ] || [ "$part" = all ]; then
    timeout 110 "${pytest[@]}" packages/engine-megatron/tests/test_megatron_gpu.py packages/engine-megatron/tests/test_megatron_single.py 2>&1 | tee "$out/gpu_megatron.log" | tail -30
    timeout 150 python3 benchmarks/gpu_step.py --out "$out/gpu_step.json" 2>&1 | grep -v Warning | tee "$out/gpu_step.log" | tail -5
fi
# The throughput cases: each case is one process (a fresh CUDA context and allocator), with a
# limit that leaves the call's other case its time; 16k: ~1-2 min per case on an H100 (start,
# flex attention's compilation, 2 + 5 steps), 64k: ~3-4 min.
tp=(python3 benchmarks/trainer_throughput.py)
if [ "$part" = throughput ] && [ "$arg" = 16k ]; then
    timeout 250 "${tp[@]}" --case 0.6b-16k --attention-kernels --out "$out/trainer_throughput_16k.json" 2>&1 \
        | grep -v Warning | tee "$out/trainer_throughput_0.6b_16k.log" | tail -25
    timeout 250 "${tp[@]}" --case 4b-lora16-16k --out "$out/trainer_throughput_16k.json" 2>&1 \
        | grep -v Warning | tee "$out/trainer_throughput_4b_lora_16k.log" | tail -15
fi
if [ "$part" = throughput ] && [ "$arg" = 64k ]; then
    timeout 330 "${tp[@]}" --case 0.6b-64k --attention-kernels --out "$out/trainer_throughput_64k.json" 2>&1 \
        | grep -v Warning | tee "$out/trainer_throughput_0.6b_64k.log" | tail -25
fi
if [ "$part" = ray ]; then
    bash benchmarks/stage_wheels.sh join 2>&1 | tee "$out/gpu_ray_stage.log" | tail -5
    [ "${PIPESTATUS[0]}" = 0 ] || exit 1
    export PYTHONPATH=${RAY_SITE:-/tmp/tephra-ray-site}:$PYTHONPATH  # where `join` installed Ray
    timeout 200 python3 benchmarks/gpu_ray.py --device cuda --timeout 170 --out "$out/gpu_ray.json" 2>&1 \
        | grep -v Warning | tee "$out/gpu_ray.log" | tail -25
fi
