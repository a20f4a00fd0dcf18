#!/bin/bash
# Issue 44's sixth sitting, prepared 2026-12-06 (not run yet): the one unit kind not yet through `qf run` at 8B,
# EXL3 4.0 bpw, alone on the card (sitting 2 reached 8 of 32 layers beside two other jobs), with its evaluation, KV
# cache evaluations and publish. exllamav3's extension comes prebuilt (sitting 5's, against the GPU image's torch
# 2.11.0+cu130), gzipped in .ext/ (setup.sh unpacks it): no 7-minute build. Expected: the model made in about a
# minute, the EXL3 unit about 1081 s (the cost model: 10 + 148 s a billion; sitting 2 saw 30-33 s a layer beside
# other units), its evaluations about 2 minutes, the sitting about 22 minutes.
# Start (carry .whl without .whl/awqct, .ext and .commit: 64 MiB in all; poll report.sh back to back, a machine
# goes back 30 s after a call ends):
#   rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -a . /tmp/repo/ && cd /tmp/repo &&
#   (setsid nohup bash benchmarks/results/gpu-2026-12-06/drive6.sh > /tmp/drive.log 2>&1 < /dev/null &)
source /tmp/repo/benchmarks/results/gpu-2026-12-06/setup.sh
python3 -c "import exllamav3.ext" > $R/ext3.log 2>&1
stamp ext3_loaded $? "$(grep -c JIT $R/ext3.log) JIT builds"
python3 benchmarks/cost_growth.py $W --shape 8b --make > $R/make.log 2>&1
stamp made_8b $? "$(du -sh $W/llama-8b | cut -f1)"
python3 benchmarks/cost_growth.py $W --shape 8b --label exl3 -- --exl3 4.0 > $R/8b-exl3.log 2>&1
stamp 8b_exl3 $?
cp benchmarks/results/cost_growth.json $R/ 2>/dev/null
stamp done
