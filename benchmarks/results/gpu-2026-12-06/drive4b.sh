#!/bin/bash
# The fourth sitting again, cut to the device time left (860 s, after failed starts) once the first try's machine
# was given back mid-run (sitting4/ holds what that try returned: the 1.1B's AWQ-CT job): the 3B shape's AutoAWQ,
# AWQ-CT and EXL2 (measurement and 4.0) and the 1.1B's AutoAWQ through benchmarks/cost_growth.py, all at once. The
# EXL3 units and the extensions' return wait for the next sitting.
source /tmp/repo/benchmarks/results/gpu-2026-12-06/setup.sh
(MAX_JOBS=8 python3 -c "import exllamav2" > $R/build2.log 2>&1; stamp built_exl2 $?) &
b2=$!
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
job 1.1b awq --awq &
wait $b2
job 3b exl2 --exl2 4.0 &
wait
cp benchmarks/results/cost_growth.json $R/ 2>/dev/null
stamp done
