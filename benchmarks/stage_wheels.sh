#!/usr/bin/env bash
# Ray for the GPU machine, which has no network and takes at most 64 MiB per device call
# (the working tree and every carried path together): Ray's cp312 wheel (~79 MB) travels in
# parts over consecutive calls of one warm session, each part copied to /tmp there, and the
# parts are joined (and checked against the whole wheel's sha256) in the call that runs Ray.
#
#   bash benchmarks/stage_wheels.sh download   here, with the registry: fills .whl/ (git-ignored)
#   bash benchmarks/stage_wheels.sh carry [--no-base] N [N ...]
#                                              here: the `carry` list of a device call (JSON)
#   bash benchmarks/stage_wheels.sh stage N    on the device: copies part N to $STAGE_DIR
#   bash benchmarks/stage_wheels.sh join       on the device: joins the parts, checks the sha256,
#                                              installs Ray and its deps into $RAY_SITE
#
# `download` writes, for the GPU machine's Python (3.12, manylinux x86-64):
#   .whl/*.whl             what every gpu_check part installs (tensordict, pyvers, transformers,
#                          peft: the versions of uv.lock)
#   .whl/ray/part-N/       N = 1..parts: ray-<version>-...whl.part-N, and in the last part the
#                          wheels of Ray's dependencies the machine lacks (deps/); MANIFEST in each
# Files larger than PART_MIB (default 32: a part, the tree (~8 MiB) and the base wheels (~15 MiB) stay well under
# the 64 MiB a call carries) are cut with `split`. RAY_VERSION, PART_MIB, STAGE_DIR (default
# /tmp/tephra-ray-stage) and RAY_SITE (default /tmp/tephra-ray-site) may be set.
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_VERSION=${RAY_VERSION:-2.60.0}
PART_MIB=${PART_MIB:-32}
STAGE_DIR=${STAGE_DIR:-/tmp/tephra-ray-stage}
RAY_SITE=${RAY_SITE:-/tmp/tephra-ray-site}
BASE=(tensordict==0.15.3 pyvers==0.2.3 transformers==5.23.0 peft==0.21.2)
# Ray's dependencies, and the app's under Ray, that the GPU machine does not have. It has torch,
# triton, transformers, accelerate, peft, safetensors, pyarrow, numpy, msgpack, protobuf,
# grpcio, aiohttp, pyyaml, requests, httpx and what those need (filelock, packaging, psutil,
# cloudpickle, tqdm, anyio, h11 ...). Ray needs click and jsonschema (with attrs, referencing,
# rpds-py, jsonschema-specifications); tephra-episodes imports starlette and uvicorn (the
# gateway) when the controller loads. Checked on a CPU by running gpu_ray.py with every
# module not known to be on the machine made unimportable. Versions: uv.lock's.
RAY_DEPS=(click==8.5.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
    referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 starlette==1.10.0 uvicorn==0.54.0)
PIP_TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64)

download() {
    python3 -m pip download -q --no-deps "${PIP_TARGET[@]}" -d .whl "${BASE[@]}"
    rm -rf .whl/ray && mkdir -p .whl/ray/full .whl/ray/deps
    python3 -m pip download -q --no-deps "${PIP_TARGET[@]}" -d .whl/ray/full "ray==$RAY_VERSION"
    python3 -m pip download -q --no-deps "${PIP_TARGET[@]}" -d .whl/ray/deps "${RAY_DEPS[@]}"
    local wheel name sum parts i
    wheel=$(ls .whl/ray/full/ray-"$RAY_VERSION"-*.whl)
    name=$(basename "$wheel")
    sum=$(sha256sum "$wheel" | cut -d' ' -f1)
    split -b "${PART_MIB}M" -d -a 1 --numeric-suffixes=1 "$wheel" ".whl/ray/full/$name.part-"
    parts=$(ls .whl/ray/full/"$name".part-* | wc -l)
    for ((i = 1; i <= parts; i++)); do
        mkdir -p ".whl/ray/part-$i"
        mv ".whl/ray/full/$name.part-$i" ".whl/ray/part-$i/"
        printf 'wheel=%s\nsha256=%s\nparts=%s\n' "$name" "$sum" "$parts" >".whl/ray/part-$i/MANIFEST"
    done
    mv .whl/ray/deps ".whl/ray/part-$parts/deps"
    # the whole wheel stays here (ignored, never carried): `join` is checked against it
    du -sh .whl/*.whl .whl/ray/part-* | sed 's/^/  /'
    echo "$name: $parts parts of at most $PART_MIB MiB, sha256 $sum"
}

carry() {  # the `carry` argument of one device call: the base wheels (unless --no-base:
    # an earlier call of the warm machine installed them) and the named parts
    local paths=() n
    if [ "${1:-}" = --no-base ]; then shift; else
        for f in .whl/*.whl; do paths+=("\"$f\""); done
    fi
    for n in "$@"; do
        [ -d ".whl/ray/part-$n" ] || { echo "no .whl/ray/part-$n: run download first" >&2; exit 1; }
        paths+=("\".whl/ray/part-$n\"")
    done
    (IFS=,; echo "[${paths[*]}]")
}

stage() {  # on the device: keep part N in /tmp until the call that joins
    local n=$1
    [ -d ".whl/ray/part-$n" ] || { echo "stage $n: .whl/ray/part-$n did not arrive (carry it)" >&2; exit 1; }
    mkdir -p "$STAGE_DIR"
    cp -r ".whl/ray/part-$n/." "$STAGE_DIR/"
    ls -l "$STAGE_DIR"
}

join() {  # on the device: every part present -> the wheel, checked, installed
    local part
    for part in .whl/ray/part-*; do  # parts carried in this very call count too
        [ -d "$part" ] && cp -r "$part/." "$STAGE_DIR/"
    done
    [ -f "$STAGE_DIR/MANIFEST" ] || { echo "join: no $STAGE_DIR/MANIFEST: stage the parts first" >&2; exit 1; }
    local wheel sum parts i missing=()
    wheel=$(sed -n 's/^wheel=//p' "$STAGE_DIR/MANIFEST")
    sum=$(sed -n 's/^sha256=//p' "$STAGE_DIR/MANIFEST")
    parts=$(sed -n 's/^parts=//p' "$STAGE_DIR/MANIFEST")
    for ((i = 1; i <= parts; i++)); do
        [ -f "$STAGE_DIR/$wheel.part-$i" ] || missing+=("$i")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "join: parts ${missing[*]} of $parts have not arrived; run 'stage N' with each" >&2
        exit 1
    fi
    for ((i = 1; i <= parts; i++)); do cat "$STAGE_DIR/$wheel.part-$i"; done >"$STAGE_DIR/$wheel"
    echo "$sum  $STAGE_DIR/$wheel" | sha256sum -c - || { rm -f "$STAGE_DIR/$wheel"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$RAY_SITE" "$STAGE_DIR/$wheel" "$STAGE_DIR"/deps/*.whl ${JOIN_PIP_ARGS:-}
    echo "installed $wheel and $(ls "$STAGE_DIR"/deps/*.whl | wc -l) dependencies into $RAY_SITE"
}

case ${1:-} in
download) download ;;
carry) shift; carry "$@" ;;
stage) stage "${2:?stage N}" ;;
join) join ;;
*) sed -n '2,22p' "$0"; exit 2 ;;
esac
