#!/usr/bin/env bash
# A lent GPU window spent on benchmarks/gpu_scale.py, in two device calls (docs/gpu.md says why and how):
#
#   bash benchmarks/gpu_window.sh prepare        # here: .gpu/a (half the GGUF, the wheels) and .gpu/b (the rest, texts)
#   call 1, carry [".gpu/a"]:  true
#   call 2, carry [".gpu/b"], at once (the machine stays warm 30 s):  bash benchmarks/gpu_window.sh run
#
# The SmolLM2 GGUF (98 MB) and the Python packages gqaify needs beyond the machine's image (18 MB of wheels) are
# more than one call carries (64 MiB with the working tree), so the first call leaves half of them there. `run`
# joins the GGUF, installs the wheels into /tmp/site, checks that gqaify imports and sees the GPU, then runs
# gpu_scale.py with a deadline that leaves the call time to hand back $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
WHEELS="transformers==5.23.0 datasets==5.2.0 huggingface_hub==2.4.0 gguf==0.19.0 tokenizers==0.23.3 dill multiprocess"

case "${1:-}" in
prepare)
    gguf="${GGUF:-$HOME/.cache/gqaify/smollm2/$GGUF_NAME}"
    [ -f "$gguf" ] || { echo "no $gguf: run 'gqaify demo' once, or set GGUF" >&2; exit 2; }
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    rm -rf .gpu && mkdir -p .gpu/a/whl .gpu/b/text
    head -c 44000000 "$gguf" > .gpu/a/gguf.part && tail -c +44000001 "$gguf" > .gpu/b/gguf.part
    for wheel in $WHEELS; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .gpu/a/whl "$wheel"
    done
    cp ../shared/assets/text/*.txt .gpu/b/text/
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from commands import write_texts; from pathlib import Path; write_texts(Path('.gpu/b/texts'))"
    du -sh .gpu/a .gpu/b
    ;;
run)
    mkdir -p /tmp/gguf && cat .gpu/a/gguf.part .gpu/b/gguf.part > "/tmp/gguf/$GGUF_NAME"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/a/whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD/src:$PWD/benchmarks" PYTHONUNBUFFERED=1
    python3 -c "import torch, gqaify.uptrain, gqaify.conversion.core; assert torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name())"
    out="${OUT:-/tmp/gpu-out}"
    python3 benchmarks/gpu_scale.py --gguf "/tmp/gguf/$GGUF_NAME" --texts .gpu/b/texts --text-dir .gpu/b/text \
        --out /tmp/gpu-scale --results "$out/gpu_recovery.json" --deadline "${DEADLINE:-500}" "${@:2}" 2>&1 | tee "$out/log.txt"
    cp /tmp/gpu-scale/gpu_scale.json /tmp/gpu-scale/run/metrics.jsonl "$out/" || true
    cp /tmp/gpu-scale/run/recovery.png "$out/" 2>/dev/null || true
    ;;
*)
    echo "usage: bash benchmarks/gpu_window.sh prepare|run [gpu_scale.py options]" >&2
    exit 2
    ;;
esac
