#!/bin/bash
# Sitting 3: the AWQ-CT job's evaluation failed at once (the GPU image has no compressed-tensors, which the parent's
# evaluation imports, and scripts/gpu_wheels did not carry it): install it from .whl/awqct, queue the job again (its
# finished quantize step kept) and run it on. Sourced pieces as setup.sh, without its start stamp and wheel install.
export PYTHONPATH=/tmp/repo:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext TORCH_CUDA_ARCH_LIST=9.0 \
    EXLLAMA_NO_SDPA=1 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH \
    PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/repo/.whl/awqct QF_COMMIT=$(cat /tmp/repo/.commit 2>/dev/null)
R=/tmp/results W=/tmp/w
cd /tmp/repo
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/awqct/compressed_tensors-*.whl \
    .whl/awqct/loguru-*.whl >> $R/pip.log 2>&1
echo "at $(date +%T) compressed-tensors installed $?" >> $R/timeline.txt
FACTORY_HOME=$W/home-8b FACTORY_DB_URL= python3 -m factory.cli retry "$1" >> $R/awq.log 2>&1
python3 benchmarks/cost_growth.py $W --shape 8b --label awqct -- --awqct --calibration builtin:mix >> $R/awq.log 2>&1
echo "at $(date +%T) awqct_again $?" >> $R/timeline.txt
