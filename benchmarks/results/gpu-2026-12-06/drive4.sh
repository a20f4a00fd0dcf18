#!/bin/bash
# The 8B's fourth sitting (issue 44), prepared 2026-12-06 and not run yet: the 3B shape's and the 1.1B's every unit
# kind through benchmarks/cost_growth.py (so cost_growth.json holds all three sizes), and exllamav3's and exllamav2's
# built extensions brought back, so that a fifth sitting carries them prebuilt and has its 25 minutes for the 8B's
# EXL3 alone (about 18 minutes; its build took 435-487 s of each sitting so far). Each `qf run` through
# benchmarks/cost_growth.py, one home per shape; expected from the cost model refit at 8B
# (factory/engines/*/memory.py): the 3B's EXL2 measurement about 217 s and 4.0 bpw 241 s, EXL3 4.0 about 454 s,
# AutoAWQ 335 s, AWQ-CT 167 s; the 1.1B's about half; all of a kind at once (the numbers are what units take beside
# each other, as a packed job's are); the sitting about 20 minutes.
# Start (carry .whl and .commit; report.sh polls; ext_back.sh, once both builds are stamped, returns the .so files):
#   rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -a . /tmp/repo/ && cd /tmp/repo &&
#   (setsid nohup bash benchmarks/results/gpu-2026-12-06/drive4.sh > /tmp/drive.log 2>&1 < /dev/null &)
source /tmp/repo/benchmarks/results/gpu-2026-12-06/setup.sh
(MAX_JOBS=8 python3 -c "import exllamav2" > $R/build2.log 2>&1; stamp built_exl2 $?) &
b2=$!
(MAX_JOBS=8 python3 -c "import exllamav3" > $R/build3.log 2>&1; stamp built_exl3 $?) &
b3=$!
python3 benchmarks/cost_growth.py $W --shape 3b --make > $R/make.log 2>&1
stamp made_3b $? "$(du -sh $W/llama-3b | cut -f1)"
python3 benchmarks/cost_growth.py $W --shape 1.1b --make >> $R/make.log 2>&1
stamp made_1.1b $?
job() {  # SHAPE LABEL QF_ARGS...: one qf run, stamped when it ends
    local shape=$1 label=$2; shift 2
    python3 benchmarks/cost_growth.py $W --shape $shape --label $label -- "$@" > $R/$shape-$label.log 2>&1
    stamp "${shape}_$label" $?
}
job 3b awq --awq &
job 3b awqct --awqct --calibration builtin:mix &
job 1.1b awqct --awqct --calibration builtin:mix &
job 1.1b awq --awq &
wait $b2
job 3b exl2 --exl2 4.0 &
job 1.1b exl2 --exl2 4.0 &
wait $b3
job 3b exl3 --exl3 4.0 &
job 1.1b exl3 --exl3 4.0 &
wait
cp benchmarks/results/cost_growth.json $R/ 2>/dev/null
stamp done
