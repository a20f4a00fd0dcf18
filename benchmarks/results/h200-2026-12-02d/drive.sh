#!/bin/bash
# Session driver on the H200 (issues 18 and 17). Started by setsid from a copy of the repo in /tmp/repo; the
# SmolLM2 GGUF arrives in two later calls as /tmp/smollm2.gguf.
#  1. exllamav2's extension builds (kept as /tmp/results/exllamav2_ext.so, to be carried prebuilt next time);
#  2. the GPU suite's standard SmolLM2 job (EXL2 3.0-6.0 + AWQ): perplexity, KLD and top-1 by bits (issue 18);
#  3. benchmarks/jobs_per_hour.py, the packed side (4 jobs, 2 slots), then one job one unit at a time (issue 17);
#  4. while the machine lasts: benchmarks/cost_growth.py at the 1.1B shape.
export PYTHONPATH=/tmp/repo:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 \
    EXLLAMA_NO_SDPA=1 PYTHONUNBUFFERED=1 QF_SMOLLM2_GGUF=/tmp/smollm2.gguf
R=/tmp/results; mkdir -p $R
cd /tmp/repo
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) $*" >> $R/timeline.txt; }
stamp start
nvidia-smi dmon -s um -d 5 > $R/dmon.txt 2>&1 &
python3 -c "import exllamav2" > $R/build.log 2>&1
stamp built $?
cp /tmp/torch_ext/exllamav2_ext/exllamav2_ext.so $R/ 2>/dev/null
while [ ! -f /tmp/smollm2.gguf ]; do sleep 2; done
stamp gguf
QF_GPU_RESULTS=$R/suite_smollm2.json bash scripts/gpu_suite tests/test_gpu.py \
    -k "smollm2 and (one_measurement or complete or quality_falls)" > $R/suite.log 2>&1
stamp suite $?
python3 benchmarks/jobs_per_hour.py /tmp/jph --side packed --jobs 4 --slots 2 --redis-server /tmp/repo/.whl/bin/redis-server \
    --out $R/jobs_per_hour.json > $R/jph.log 2>&1
stamp jph_packed $?
python3 benchmarks/jobs_per_hour.py /tmp/jph --side one_at_a_time --side-jobs 1 --jobs 4 \
    --redis-server /tmp/repo/.whl/bin/redis-server --out $R/jobs_per_hour.json >> $R/jph.log 2>&1
stamp jph_one $?
python3 benchmarks/cost_growth.py /tmp/growth --shapes 1.1b --out $R/cost_growth.json > $R/growth.log 2>&1
stamp growth $?
stamp done
