#!/bin/bash
# Session driver on the GPU (issue 44, first sitting): the random 8B Llama (hidden 4096, 32 layers, 32/8 heads,
# intermediate 14336, vocab 32000) through AutoAWQ, AWQ-CT and EXL3 4.0 with `qf run` (benchmarks/cost_growth.py),
# each step's seconds against the ETA's expectation, peak GPU and host memory, disk. Started by setsid from a copy of
# the repo in /tmp/repo.
#  1. wheels into /tmp/site (AWQ-CT's pinned packages from .whl/awqct, no index); exllamav3's extension builds in
#     the background with all cores (the 8B's EXL2 units are the second sitting's);
#  2. the 8B made on the GPU; `qf run --awq --awqct` starts at once (its FP16 evaluation and KL reference with it);
#  3. when exllamav3's extension is built: `qf run --exl3 4.0` in the same home (the FP16 reference made once);
#     EXL3=0 leaves EXL3 out (a sitting with too few minutes left for its build and conversion) and runs AutoAWQ's
#     job alone, then AWQ-CT's, so that each one's seconds are its own.
source /tmp/repo/benchmarks/results/gpu-2026-12-06/setup.sh
free -b -s 2 > $R/free.txt 2>&1 &
if [ "${EXL3:-1}" = 1 ]; then
    (MAX_JOBS=16 python3 -c "import exllamav3" > $R/build3.log 2>&1; stamp built_exl3 $?) &
    b3=$!
fi
python3 benchmarks/cost_growth.py $W --shape 8b --make > $R/make.log 2>&1
stamp made $? "$(du -sh $W/llama-8b | cut -f1)"
python3 -m factory.cli plan $W/llama-8b --vram 80GB --ctx 8192 --json > $R/plan.json 2> $R/plan.err
if [ "${EXL3:-1}" = 1 ]; then
    python3 benchmarks/cost_growth.py $W --shape 8b --label awq -- --awq --awqct > $R/awq.log 2>&1 &
    a=$!
    wait $b3
    python3 benchmarks/cost_growth.py $W --shape 8b --label exl3 -- --exl3 4.0 > $R/exl3.log 2>&1 &
    e=$!
    wait $a; stamp awq_job $?
    wait $e; stamp exl3_job $?
else  # a short sitting: AutoAWQ's job alone (the FP16 reference with it), then AWQ-CT's
    python3 benchmarks/cost_growth.py $W --shape 8b --label awq -- --awq > $R/awq.log 2>&1
    stamp awq_job $?
    python3 benchmarks/cost_growth.py $W --shape 8b --label awqct -- --awqct > $R/exl3.log 2>&1
    stamp awqct_job $?
fi
cp benchmarks/results/cost_growth.json $R/ 2>/dev/null
stamp done
