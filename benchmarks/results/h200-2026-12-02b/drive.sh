#!/bin/bash
# Session driver on the H200 (issue 17): builds exllamav2's extension, then benchmarks/packing.py of the random 1.1B
# Llama at 4 EXL2 sizes, packed and one unit at a time. Started by setsid from a copy of the repo in /tmp/repo.
export PYTHONPATH=/tmp/repo:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 \
    EXLLAMA_NO_SDPA=1 PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p $R
cd /tmp/repo
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) $*" >> $R/timeline.txt; }
stamp start
python3 -c "import exllamav2" > $R/build2.log 2>&1; stamp built2 $?
python3 benchmarks/packing.py /tmp/bench --bpw 2.5,3.0,4.0,5.0 --out $R/packing.json > $R/packing.log 2>&1
stamp packing $?
stamp done
