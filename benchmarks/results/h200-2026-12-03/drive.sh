#!/bin/bash
# Session driver on the H200 (issue 32, items 4 and 5): the coverage of the GPU engines. Started by setsid from a
# copy of the repo in /tmp/repo. transformers 5.24 (the CPU venv's) is carried in .whl/tf so the tiny checkpoints
# of every family are built here as they are on CPU (the image's 5.17 lacks some families).
#  1. wheels into /tmp/site; exllamav2's and exllamav3's extensions build at once, 8 cores each;
#  2. as soon as exllamav2's is built: benchmarks/coverage.py --engine exl2, 6 architectures at once;
#  3. as soon as exllamav3's is built: benchmarks/coverage.py --engine exl3, 10 at once.
export PYTHONPATH=/tmp/repo:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext TORCH_CUDA_ARCH_LIST=9.0 \
    EXLLAMA_NO_SDPA=1 PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p $R
cd /tmp/repo
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) $*" >> $R/timeline.txt; }
stamp start
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/exl3/*.whl \
    .whl/tf/*.whl > $R/pip.log 2>&1
stamp wheels $?
nvidia-smi dmon -s um -d 5 > $R/dmon.txt 2>&1 &
(MAX_JOBS=8 python3 -c "import exllamav2" > $R/build2.log 2>&1; stamp built_exl2 $?) &
b2=$!
(MAX_JOBS=12 python3 -c "import exllamav3" > $R/build3.log 2>&1; stamp built_exl3 $?) &
b3=$!
wait $b2
python3 benchmarks/coverage.py /tmp/cov2 --engine exl2 --jobs 6 --out $R/coverage-h200.json > $R/exl2.log 2>&1 &
c2=$!
wait $b3
python3 benchmarks/coverage.py /tmp/cov3 --engine exl3 --jobs 10 --out $R/coverage-h200-exl3.json > $R/exl3.log 2>&1 &
c3=$!
wait $c2; stamp exl2 $?
wait $c3; stamp exl3 $?
stamp done
