#!/bin/bash
# One GPU sitting (issue 48): every family EXL3 claims through `qf run --exl3 4.0`, `qf pull` and the pulled quant
# re-scored by exllamav3 to the published perplexity (benchmarks/coverage.py --engine exl3 --claimed: the families
# the committed results do not prove first, then the families EXL3 does not claim yet: Qwen3.5, Qwen3.5-MoE and Gemma 4
# as released, Qwen3.5's language models alone, LFM2-MoE and HunYuan V3; then the claimed ones proven before, again).
# JOBS families at once (default 10: the 2026-12-03 sitting's pace, about 220 s a family), each one's row written to
# benchmarks/results/coverage-h200.json as it finishes. The tiny Qwen2, Cohere, Cohere 2, dots.llm1, ERNIE 4.5-MoE,
# LFM2, GLM-4.7-Flash, MiniMax-M2 and Qwen3-VL were remade as their releases are on 2026-12-07
# (tests/support/tiny_archs.py, tiny_vlms.py): their committed EXL3 rows are of the earlier checkpoints.
# The committed EXL3 rows of gemma2 and gemma3 (and EXL2's of gemma, gemma2, phi3) predate the SentencePiece
# tokenizer.model of those tiny checkpoints (tiny_archs.py SENTENCEPIECE: other token streams); the next sitting remakes
# EXL3's, as it runs every family EXL3 claims.
#
# Before the sitting, here: scripts/gpu_wheels fills .whl (the project's wheels), .whl/exl3 (exllamav3 and what it
# imports) and .whl/tf (transformers, tokenizers and huggingface_hub as the CPU venv pins them, so the tiny
# checkpoints are built as on CPU); `git rev-parse HEAD > .commit`. What this sitting installs (.whl/*.whl,
# .whl/exl3, .whl/tf) is about 58 MB, 62 with the tracked tree, of the 64 MiB a call carries: move .whl/awqct and
# .whl/bin out of .whl for it. .whl/tf must keep kernels: carried without it (2026-12-07), 32 of 36 families were
# refused with "Kernels are not available" (benchmarks/results/h100-2026-12-07/).
# Then one device call, carrying .whl and .commit:
#     rm -rf /tmp/repo && cp -r . /tmp/repo && cd /tmp/repo &&
#     setsid nohup bash benchmarks/exl3_sitting.sh > /tmp/sitting.out 2>&1 < /dev/null & sleep 540;
#     bash /tmp/repo/benchmarks/exl3_sitting.sh --poll
# and then calls of `sleep 540; bash /tmp/repo/benchmarks/exl3_sitting.sh --poll` (what it has so far into $OUT;
# the machine goes back when no call holds it) until the timeline says done. After it, here: commit the last poll's
# coverage-h200.json into benchmarks/results/ (and its timeline.txt under benchmarks/results/h200-<date>/), run
# `python benchmarks/coverage.py --unproven exl3` (it should print {}), make factory/engines/exl3/engine.py's
# ARCHITECTURES what the run proved (tests/integration/test_coverage.py checks it; a dropped claim's reason goes in the
# README), and regenerate the README's table (`python benchmarks/coverage.py --table`).
#  1. the wheels into /tmp/site; exllamav3's extension is built with every core (about 4.5 min on 16), the whole
#     script running in the background of the device call that starts it;
#  2. the coverage, JOBS families at once, each making its tiny checkpoint first.
R=/tmp/results W=/tmp/cov3
if [ "$1" = --poll ]; then
    mkdir -p "$OUT"
    cp $R/timeline.txt /tmp/repo/benchmarks/results/coverage-h200.json "$OUT"/ 2>/dev/null
    tail -c 30000 $R/exl3.log > "$OUT"/exl3.log 2>/dev/null
    tail -c 4000 $R/build3.log $R/pip.log > "$OUT"/setup.log 2>/dev/null
    tail -c 4000 $R/dmon.txt > "$OUT"/dmon.txt 2>/dev/null
    cat $R/timeline.txt 2>/dev/null
    grep -c '"status": "quantized"' $R/exl3.log 2>/dev/null; grep -c '"status": "refused"' $R/exl3.log 2>/dev/null
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
    .whl/tf/*.whl > $R/pip.log 2>&1
stamp wheels $?
python3 -c "import transformers, tokenizers, factory.cli; print(transformers.__version__, tokenizers.__version__)" \
    >> $R/pip.log 2>&1
nvidia-smi dmon -s um -d 5 > $R/dmon.txt 2>&1 &
# every conversion imports exllamav3: its extension is built once, before any of them
MAX_JOBS=$(nproc) python3 -c "import exllamav3" > $R/build3.log 2>&1
stamp built_exl3 $?
python3 benchmarks/coverage.py $W --engine exl3 --claimed --jobs ${JOBS:-10} \
    --arch qwen3_5,qwen3_5_moe,gemma4,qwen3_5_text,qwen3_5_moe_text,lfm2_moe,hy_v3 \
    --out benchmarks/results/coverage-h200.json > $R/exl3.log 2>&1
stamp exl3 $?
cp benchmarks/results/coverage-h200.json $R/
stamp done
