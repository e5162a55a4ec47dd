#!/usr/bin/env bash
# Wheels for a lent GPU machine (see the device tool's README): its image has torch, transformers 5.17 and
# accelerate 1.15 but no trl, datasets, bitsandbytes or pydantic, and nothing can be fetched there. Run this
# here, in the repository root (a machine that reaches the package registry); it downloads into .whl/ (ignored by
# git, carried with `carry: [".whl"]`), for CPython 3.12 on x86-64 Linux, the versions of requirements-compat.txt
# (the stack `make test-compat` tests) plus the dependencies the image lacks, and prints the command to run there.
# About 15 MB (bitsandbytes trimmed to its CUDA 13 library); a call carries at most 64 MiB with the repository.
#
#   bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."

pinned() {  # the version requirements-compat.txt pins for a package: "name==version"
    grep -E "^$1==" requirements-compat.txt || { echo "requirements-compat.txt pins no $1" >&2; exit 1; }
}

packages=(
    "$(pinned trl)" "$(pinned datasets)" "$(pinned peft)" "$(pinned bitsandbytes)"
    # what they need beyond the image (datasets 4.8: dill < 0.4.2, multiprocess < 0.70.20, fsspec <= 2026.2.0;
    # pydantic 2.14.3: pydantic-core 2.50.4, typing-extensions >= 4.16)
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
    dill==0.4.1 multiprocess==0.70.19 fsspec==2026.2.0
    hjson==3.1.0 py-cpuinfo==9.0.0   # deepspeed's, beyond the image (for --launch zero3 / ulysses)
    liger-kernel==0.8.5              # train.use_liger_kernel (pure Python over the image's Triton)
)

exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
mkdir -p .whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${packages[@]}"
# deepspeed is published as source only; built without its compiled ops it is a pure-Python wheel
python3 -m pip wheel -q --no-deps -w .whl "$(pinned deepspeed)"
# bitsandbytes ships a library per CUDA and ROCm version (43 MB); the image's torch is built for CUDA 13 (2026-11),
# so keep CUDA 13's and the CPU one: 7 MB, which leaves room for .fa/ (scripts/gpu_flash_attn_src.sh) in a call
python3 - <<'EOF'
import glob
import re
import zipfile

wheel = glob.glob(".whl/bitsandbytes-*.whl")[0]
with zipfile.ZipFile(wheel) as source:
    entries = [(item, source.read(item.filename)) for item in source.infolist()
               if not re.search(r"libbitsandbytes_(rocm|cuda(?!13))", item.filename)]
with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as target:
    for item, data in entries:
        target.writestr(item, data)
EOF

echo "downloaded into .whl/ ($(du -sh .whl | cut -f1)):"
ls .whl
cat <<'EOF'

On the GPU machine (device tool `run`, carry [".whl"]), begin the command with:
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit;
then, e.g.:
  python3 scripts/gpu_check.py --work-dir /tmp/gc --attentions sdpa --no-kernel-check --report $OUT/sdpa.json
flash-attn is source only on PyPI: scripts/gpu_flash_attn_src.sh prepares a build that fits a call.
EOF
