#!/bin/bash
# One GPU sitting (issue 46): GGUF's CUDA path, never run on a GPU before. llama.cpp built for CUDA from the pinned
# sdist (factory/engines/gguf/llama.py, `python -m factory.engines.gguf.build`, with FACTORY_LLAMA_CPP_SDIST: the
# device has no PyPI), then tests/gpu/test_gpu_gguf.py: a `qf run --gguf Q4_K_M,IQ4_XS` of the tiny Llama and of the
# random 1.1B on the card, the pulled file scored there to the published perplexity and by the same build on the CPU
# to the same numbers (results: $R/gpu_gguf.json, timeline: $R/timeline.txt).
#
# What it needs does not fit one call's 64 MiB (the sdist alone is 77 MB; the device has no cmake), so three calls
# carry it, back to back (the machine stays 30 s after a call), each copying its part out of the tree:
#   here, once:  bash benchmarks/gguf_sitting.sh --prepare      (needs .venv and scripts/gpu_wheels' .whl; fills .sit/)
#   call 1, carry [".sit/1", ".commit"]:  bash benchmarks/gguf_sitting.sh --take 1
#   call 2, carry [".sit/2"]:             bash benchmarks/gguf_sitting.sh --take 2
#   call 3, carry [".sit/3"]:             bash benchmarks/gguf_sitting.sh --take 3 && rm -rf /tmp/repo &&
#       cp -r . /tmp/repo && cd /tmp/repo && (setsid nohup bash benchmarks/gguf_sitting.sh > /tmp/sitting.out 2>&1 < /dev/null &);
#       sleep 540; bash /tmp/repo/benchmarks/gguf_sitting.sh --poll
# then `sleep 300; bash /tmp/repo/benchmarks/gguf_sitting.sh --poll` until the timeline says done. After it, here:
# the last poll's files into benchmarks/results/h100-<date>-gguf/ (or h200-), and the README's GGUF row says CUDA ran.
#  1. the wheels into /tmp/site (cmake and ninja among them), the sdist put together and checked by the build;
#  2. llama.cpp built for CUDA with every core (GGML_CUDA, the card's own architecture);
#  3. the GPU test, each result written as it comes.
R=/tmp/results C=/tmp/carry
case "$1" in
--prepare)
    set -euo pipefail
    cd "$(dirname "$0")/.."
    [ -d .whl/tf ] && [ -d .whl/build ] || { echo "run scripts/gpu_wheels first" >&2; exit 2; }
    rm -rf .sit && mkdir -p .sit/1 .sit/2 .sit/3 .gguf/sdist
    ln .whl/*.whl .whl/tf/*.whl .whl/build/sentencepiece-*.whl .sit/1/  # the project's wheels, transformers as here
    ln .whl/build/cmake-*.whl .whl/build/ninja-*.whl .sit/2/
    sdist=.gguf/sdist/$(.venv/bin/python -c "from factory.engines.gguf import llama; print(llama.SDIST)")
    [ -f "$sdist" ] || .venv/bin/python -m pip download -q --no-deps --no-binary :all: -d .gguf/sdist \
        "llama-cpp-python==$(.venv/bin/python -c "from factory.engines.gguf import llama; print(llama.VERSION)")"
    split -n 3 -d "$sdist" .sit/sdist.
    mv .sit/sdist.00 .sit/2/ && mv .sit/sdist.01 .sit/sdist.02 .sit/3/
    git rev-parse HEAD > .commit
    du -sh .sit/* && echo "each under 58 MB, with the tree's 6: carry them one call each as this header says"
    exit 0 ;;
--take)
    mkdir -p $C && cp ".sit/$2"/* $C/ && cp .commit $C/ 2>/dev/null
    ls $C | wc -l
    exit 0 ;;
--poll)
    mkdir -p "$OUT"
    cp $R/timeline.txt $R/gpu_gguf.json "$OUT"/ 2>/dev/null
    tail -c 20000 $R/test.log > "$OUT"/test.log 2>/dev/null
    tail -c 8000 $R/build.log > "$OUT"/build.log 2>/dev/null
    tail -c 4000 $R/pip.log > "$OUT"/pip.log 2>/dev/null
    cat $R/timeline.txt 2>/dev/null
    exit 0 ;;
esac
export PYTHONPATH=/tmp/repo:/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:/usr/local/cuda/bin:$PATH \
    QF_COMMIT=$(cat $C/.commit 2>/dev/null) FACTORY_LLAMA_CPP_SDIST=/tmp/sdist/llama_cpp_python.tar.gz \
    QF_GPU_RESULTS=$R/gpu_gguf.json
mkdir -p $R /tmp/sdist
cd /tmp/repo
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) $*" >> $R/timeline.txt; }
stamp start "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)" "$(nproc) cores" \
    "$(df -h /tmp | awk 'NR==2{print $4}') free" "commit $QF_COMMIT" "nvcc $(command -v nvcc)"
cat $C/sdist.0? > $FACTORY_LLAMA_CPP_SDIST
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $C/*.whl > $R/pip.log 2>&1
stamp wheels $? "$(cmake --version | head -1)"
python3 -m factory.engines.gguf.build > $R/build.log 2>&1
stamp built $? "$(tail -1 $R/build.log)"
python3 -m pytest -m gpu -p no:cacheprovider -q -rA tests/gpu/test_gpu_gguf.py > $R/test.log 2>&1
stamp test $?
stamp done
