#!/bin/bash
# One GPU sitting (issue 49): the ranking with every format on one axis, EXL2 and EXL3 among them. On the CPU the
# README's rankings have no EXL2 or EXL3 rows (both need CUDA; the H200's EXL2 quants of SmolLM2 and the H100's EXL3
# quants of Gemma were scored on other windows than the CPU's, so they are named and left out, never ranked). Here one
# `qf run` per model makes every format the model takes on one card, scored against one FP16 evaluation on the same
# 16 windows of builtin:wiki, in one catalog, and `qf plan` ranks them:
#   SmolLM2-135M-Instruct: EXL2 2.5, 3.0, 4.0, 5.0, 6.0 (exllamav2), AutoAWQ and AWQ-CT w4g64, GGUF Q8_0, Q6_K, Q5_K_M,
#     Q4_K_M, IQ4_XS, Q3_K_M (llama.cpp built for CUDA); not EXL3 (exllamav3 1.6.5 takes no hidden size of 576);
#   Gemma-3-270M: EXL3 3.0, 4.0, 5.0 (exllamav3), AWQ-CT w4g32, the same GGUF types; not AutoAWQ (no Gemma 3) nor EXL2.
# Both models' "FP16" is a dequantized GGUF (tests/support/smollm2.py, tests/support/gemma.py): the cards say so, and
# GGUF's types are favoured on them. The gate is opened to 3 x FP16's perplexity so that the small sizes are published
# and ranked (SmolLM2's EXL2 2.5 was 2.5 x FP16 on the H200); what the default gate refuses the ranking then shows.
#
# What it needs (about 600 MB: the wheels, llama.cpp's sdist with cmake and ninja, SmolLM2's and Gemma's GGUFs) is one
# tar cut into parts of 52 MiB, one call each (a call carries 64 MiB); the call that brings the last part starts it:
#   here, once:      scripts/gpu_wheels, then  bash benchmarks/ranking_sitting.sh --prepare   (it prints the calls)
#   call K of N, carry [".sit/K"]:   bash benchmarks/ranking_sitting.sh --take K N
#   then:            sleep 420; bash /tmp/repo/benchmarks/ranking_sitting.sh --poll     (again until "done")
# After it, here: the last poll's files into benchmarks/results/<card>-<date>-ranking/, the README's ranking section
# gains both tables and both plots.
# Expected: the three builds at once on 16 cores about 6 minutes (exllamav2 150 s, exllamav3 240 s, llama.cpp 205 s
# each alone), SmolLM2's and Gemma's jobs side by side about 5 minutes.
R=/tmp/results W=/tmp/w C=/tmp/carry
case "$1" in
--prepare)
    set -euo pipefail
    cd "$(dirname "$0")/.."
    [ -d .whl/tf ] && [ -d .whl/exl3 ] && [ -d .whl/awqct ] && [ -d .whl/build ] && [ -d .gguf/gemma-tokenizer ] ||
        { echo "run scripts/gpu_wheels first" >&2; exit 2; }
    rm -rf .sit && mkdir -p .sit/x/site .sit/x/gemma .gguf/sdist
    sdist=.gguf/sdist/$(.venv/bin/python -c "from factory.engines.gguf import llama; print(llama.SDIST)")
    [ -f "$sdist" ] || .venv/bin/python -m pip download -q --no-deps --no-binary :all: -d .gguf/sdist \
        "llama-cpp-python==$(.venv/bin/python -c "from factory.engines.gguf import llama; print(llama.VERSION)")"
    ln .whl/*.whl .whl/exl3/*.whl .whl/tf/*.whl .whl/build/*.whl .sit/x/site/
    cp -r .whl/awqct .gguf/gemma-tokenizer .sit/x/
    ln "$sdist" .sit/x/llama_cpp_python.tar.gz
    ln .gguf/gemma/*.whl .sit/x/gemma/
    cp "$(.venv/bin/python -c "from tests.support.smollm2 import gguf_path; print(gguf_path())")" .sit/x/smollm2.gguf
    git rev-parse HEAD > .sit/x/commit
    tar -C .sit/x -cf - . | split -b 52M -d -a 2 - .sit/part.
    rm -rf .sit/x
    n=$(ls .sit/part.* | wc -l)
    for i in $(seq 1 "$n"); do mkdir .sit/$i && mv .sit/part.$(printf %02d $((i - 1))) .sit/$i/; done
    du -sh .sit/*
    echo "$n calls, back to back: call K (1 to $n) carries [\".sit/K\"] and runs: bash benchmarks/ranking_sitting.sh --take K $n"
    exit 0 ;;
--take)
    mkdir -p $C && cp .sit/"$2"/part.* $C/ && ls $C/part.* | wc -l
    [ "$(ls $C/part.* | wc -l)" -eq "$3" ] || exit 0
    mkdir -p $C/x && cat $C/part.* | tar -C $C/x -xf - && rm $C/part.*
    rm -rf /tmp/repo && cp -r . /tmp/repo && rm -rf /tmp/repo/.sit && cp $C/x/commit /tmp/repo/.commit
    cd /tmp/repo && (setsid nohup bash benchmarks/ranking_sitting.sh > /tmp/sitting.out 2>&1 < /dev/null &)
    echo "started"
    exit 0 ;;
--poll)
    mkdir -p "$OUT"
    cp $R/timeline.txt $R/*.plan.txt $R/*.plan.json $R/*.ls.json $R/*-frontier.svg $R/*.events.jsonl "$OUT"/ 2>/dev/null
    for f in $R/*.log; do tail -c 6000 "$f" > "$OUT/$(basename "$f")"; done 2>/dev/null
    cat $R/timeline.txt 2>/dev/null
    exit 0 ;;
esac
export PYTHONPATH=/tmp/repo:/tmp/site TORCH_EXTENSIONS_DIR=/tmp/torch_ext TORCH_CUDA_ARCH_LIST=9.0 \
    EXLLAMA_NO_SDPA=1 PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:/usr/local/cuda/bin:$PATH MAX_JOBS=16 \
    PIP_NO_INDEX=1 PIP_FIND_LINKS=$C/x/awqct FACTORY_LLAMA_CPP_SDIST=$C/x/llama_cpp_python.tar.gz
mkdir -p $R $W
cd /tmp/repo
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) $*" >> $R/timeline.txt; }
stamp start "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)" "$(nproc) cores" \
    "$(df -h /tmp | awk 'NR==2{print $4}') free" "commit $(cat .commit)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $C/x/site/*.whl > $R/pip.log 2>&1
stamp wheels $?
nvidia-smi dmon -s um -d 5 > $R/dmon.log 2>&1 &
# each engine's extension (or build) once, before any unit imports it, the three at once
python3 -c "import exllamav2" > $R/build_exl2.log 2>&1 & a=$!
python3 -c "import exllamav3" > $R/build_exl3.log 2>&1 & b=$!
python3 -m factory.engines.gguf.build > $R/build_llama.log 2>&1 & c=$!
wait $a; stamp built_exl2 $?
wait $b; stamp built_exl3 $?
wait $c; stamp built_llama $? "$(tail -1 $R/build_llama.log)"
python3 -c "import sys; from pathlib import Path; from tests.support.smollm2 import convert
convert(Path(sys.argv[1]), Path(sys.argv[2]))" $W/SmolLM2-135M-Instruct $C/x/smollm2.gguf > $R/models.log 2>&1
stamp smollm2_made $?
python3 -m tests.support.gemma $W/gemma-3-270m --parts $C/x/gemma --tokenizer $C/x/gemma-tokenizer >> $R/models.log 2>&1
stamp gemma_made $?
GGUF="gguf: {types: [Q8_0, Q6_K, Q5_K_M, Q4_K_M, IQ4_XS, Q3_K_M]}"
printf '%s\n' "exl2: {bpw: [2.5, 3.0, 4.0, 5.0, 6.0]}" "awq: {}" "awqct: {}" "$GGUF" "eval_windows: 16" \
    "max_ppl_ratio: 3.0" > $W/smollm2.yaml
printf '%s\n' "exl3: {bpw: [3.0, 4.0, 5.0]}" "awqct: {group_size: 32}" "$GGUF" "eval_windows: 16" \
    "max_ppl_ratio: 3.0" > $W/gemma.yaml
# job NAME SOURCE: one `qf run` in a catalog of its own, then the ranking at 24 GB and 8192 tokens, the plot, the rows
job() {
    export FACTORY_HOME=$W/home-$1
    python3 -m factory.cli run "$2" --recipe $W/$1.yaml --name "$3" --json > $R/$1.events.jsonl 2> $R/$1.log
    stamp "$1_job" $? "$(tail -1 $R/$1.events.jsonl | cut -c 1-300)"
    COLUMNS=120 python3 -m factory.cli plan "$3" --vram 24GB --ctx 8192 > $R/$1.plan.txt 2>> $R/$1.log
    python3 -m factory.cli plan "$3" --vram 24GB --ctx 8192 --json > $R/$1.plan.json 2>> $R/$1.log
    python3 -m factory.cli show "$3" --frontier $R/$1-frontier.svg >> $R/$1.log 2>&1
    python3 -m factory.cli ls --json > $R/$1.ls.json 2>> $R/$1.log
    stamp "$1_ranked" $?
}
job smollm2 $W/SmolLM2-135M-Instruct smollm2-135m-instruct & a=$!
job gemma $W/gemma-3-270m gemma-3-270m & b=$!
wait $a $b
stamp done
