#!/bin/bash
# Session driver on the H200 (issue 33, EXL3's half): the vision-language families through exllamav3. Started by
# setsid from a copy of the repo in /tmp/repo. transformers 5.24 is carried in .whl/tf so the tiny checkpoints are
# built as on CPU (tests/tiny_vlms.py: the image's 5.17 saves some families otherwise).
#  1. wheels into /tmp/site; exllamav3's extension builds with all 16 cores;
#  2. then at once: benchmarks/coverage.py --engine exl3 on the five families exllamav3 has architecture files for
#     (each: qf run, qf pull, the pulled quant re-scored and given an image), and the GPU test of a Gemma 3
#     vision-language quant (tests/test_gpu_exl3.py -k vision_language).
export PYTHONPATH=/tmp/repo:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext TORCH_CUDA_ARCH_LIST=9.0 \
    EXLLAMA_NO_SDPA=1 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
R=/tmp/results; mkdir -p $R
cd /tmp/repo
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) $*" >> $R/timeline.txt; }
stamp start
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/exl3/*.whl \
    .whl/tf/*.whl > $R/pip.log 2>&1
stamp wheels $?
python3 -c "import transformers, factory.cli; print(transformers.__version__)" >> $R/pip.log 2>&1
nvidia-smi dmon -s um -d 5 > $R/dmon.txt 2>&1 &
MAX_JOBS=16 python3 -c "import exllamav3" > $R/build3.log 2>&1
stamp built_exl3 $?
python3 benchmarks/coverage.py /tmp/cov3 --engine exl3 --arch gemma3,mistral3,qwen2_5_vl,qwen3_vl,glm4v --jobs 5 \
    --out benchmarks/results/coverage-h200.json > $R/exl3.log 2>&1 &
c3=$!
QF_GPU_RESULTS=$R/gpu_suite_vlm.json python3 -m pytest -x -q -m gpu tests/test_gpu_exl3.py -k vision_language \
    -p no:cacheprovider > $R/gpu_test.log 2>&1
stamp gpu_test $?
wait $c3; stamp exl3 $?
cp benchmarks/results/coverage-h200.json $R/
stamp done
