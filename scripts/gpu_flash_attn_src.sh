#!/usr/bin/env bash
# flash-attn for a lent GPU machine that cannot reach a package index. PyPI has flash-attn as source only, and the
# whole build (every head dim, fp16 and bf16, Ampere to Blackwell) takes far longer than such a machine is lent for.
# Run this here, in the repository root: it downloads the flash-attn source from PyPI and trims it to what
# scripts/gpu_check.py and the GPU tests use (bf16, head dims 32, 64 and 128, no dropout, ALiBi or softcap; built
# for sm_90 by the command below), into .fa/flash-src.tgz (about 2.6 MB; .fa/ is ignored by git, carry it with
# `carry: [".whl", ".fa"]`). A head dim over 128 or fp16 input stops with a clear error from the trimmed build.
# Built on an H100 in 333 s (16 cores, MAX_JOBS=10, beside a training run); the wheel is about 7.8 MB.
#
#   bash scripts/gpu_flash_attn_src.sh
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
VERSION=2.8.3.post2

exclude="$(git rev-parse --git-path info/exclude)"
grep -qxF "/.fa/" "$exclude" 2>/dev/null || echo "/.fa/" >> "$exclude"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
url="$(curl -fsSL https://pypi.org/simple/flash-attn/ | grep -o "https://[^\"#]*/flash_attn-$VERSION\.tar\.gz" | head -1)"
[ -n "$url" ] || { echo "flash-attn $VERSION's source is not on PyPI's index" >&2; exit 1; }
curl -fsSL "$url" | tar xz -C "$work"
mv "$work/flash_attn-$VERSION" "$work/flash-attn"
cd "$work/flash-attn"
rm -rf csrc/composable_kernel csrc/flash_attn_ck hopper tests csrc/layer_norm csrc/fused_dense_lib
find csrc/cutlass -mindepth 1 -maxdepth 1 ! -name include -exec rm -rf {} +
python3 - <<'EOF'
import re
from pathlib import Path

setup = Path("setup.py").read_text()
start = setup.index('sources=[', setup.index('name="flash_attn_2_cuda"'))
end = setup.index("],", start)
kept = [line for line in setup[start:end].splitlines()[1:]
        if "flash_api.cpp" in line or re.search(r"hdim(32|64|128)_bf16", line)]
setup = setup[:start] + "sources=[\n" + "\n".join(kept) + "\n            " + setup[end:]
for flag in ("DROPOUT", "ALIBI", "SOFTCAP"):
    setup = setup.replace(f'# "-DFLASHATTENTION_DISABLE_{flag}",', f'"-DFLASHATTENTION_DISABLE_{flag}",', 1)
Path("setup.py").write_text(setup)

header = Path("csrc/flash_attn/src/static_switch.h")
text = header.read_text()
begin = text.index("#define FP16_SWITCH")
finish = text.index("}()", text.index("#define HEADDIM_SWITCH")) + 3
header.write_text(text[:begin] + r"""// trimmed by longpeft's scripts/gpu_flash_attn_src.sh: bf16, head dims up to 128 (32, 64, 128 kernels)
#define FP16_SWITCH(COND, ...)                                           \
  [&] {                                                                  \
    TORCH_CHECK(!(COND), "this trimmed flash-attn build has bf16 only");  \
    using elem_type = cutlass::bfloat16_t;                               \
    return __VA_ARGS__();                                                \
  }()

#define HEADDIM_SWITCH(HEADDIM, ...)                                                   \
  [&] {                                                                                \
    TORCH_CHECK(HEADDIM <= 128, "this trimmed flash-attn build has head dims <= 128");  \
    if (HEADDIM <= 32) {                                                               \
      constexpr static int kHeadDim = 32;                                              \
      return __VA_ARGS__();                                                            \
    } else if (HEADDIM <= 64) {                                                        \
      constexpr static int kHeadDim = 64;                                              \
      return __VA_ARGS__();                                                            \
    } else {                                                                           \
      constexpr static int kHeadDim = 128;                                             \
      return __VA_ARGS__();                                                            \
    }                                                                                  \
  }()""" + text[finish:])
print(f"kept {len(kept)} of the sources")
EOF
mkdir -p "$repo/.fa"
tar czf "$repo/.fa/flash-src.tgz" -C "$work" flash-attn
cd "$repo"
echo "wrote .fa/flash-src.tgz ($(du -h .fa/flash-src.tgz | cut -f1))"
cat <<'EOF'

On the GPU machine (device tool `run`, carry [".whl", ".fa"]), after the wheels of scripts/gpu_wheels.sh, build it
(in the background beside a first run, if you like) and bring the wheel back through $OUT for later calls:
  mkdir -p /tmp/fab /tmp/faw && tar xzf .fa/flash-src.tgz -C /tmp/fab && cd /tmp/fab/flash-attn && \
    FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS=90 MAX_JOBS=10 NVCC_THREADS=2 \
    python3 -m pip wheel --no-build-isolation --no-deps -w /tmp/faw . && cd - && \
    python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/faw/*.whl && cp /tmp/faw/*.whl $OUT/
EOF
