#!/bin/bash
# Issue 44's sixth sitting, prepared 2026-12-06, run 2026-12-07 on an H100 (results in sitting6/): the one unit kind
# not yet through `qf run` at 8B, EXL3 4.0 bpw, alone on the card (sitting 2 reached 8 of 32 layers beside two other
# jobs), with its evaluation, KV cache evaluations and publish. exllamav3's extension comes prebuilt where the session still has sitting 5's
# (against the GPU image's torch 2.11.0+cu130, gzipped in the ignored .ext/: setup.sh unpacks it); a new session's
# checkout lacks it, and the sitting builds it first with all 16 cores, beside the model's making (409 s at 8 jobs
# beside other work in sitting 5). Expected: the EXL3 unit about 1081 s (the cost model: 10 + 148 s a billion; sitting
# 2 saw 30-33 s a layer beside other units), its evaluations about 2 minutes; the sitting about 22 minutes with the
# extension carried, 27 without. exllamav3's extension alone with 16 jobs took 246 s on an H100 (2026-12-06, the
# exl3opt sitting): start this sitting first in a session, while its 30 minutes of device time are whole (every
# refused start costs a minute or two of them; on 2026-12-06 six refusals left 18 minutes, too few for it).
# Start (carry .whl without .whl/awqct and .commit, and .ext where it is here: 64 MiB in all; poll report.sh back
# to back, a machine goes back 30 s after a call ends):
#   rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -a . /tmp/repo/ && cd /tmp/repo &&
#   (setsid nohup bash benchmarks/results/gpu-2026-12-06/drive6.sh > /tmp/drive.log 2>&1 < /dev/null &)
source /tmp/repo/benchmarks/results/gpu-2026-12-06/setup.sh
(MAX_JOBS=16 python3 -c "import exllamav3.ext" > $R/ext3.log 2>&1; stamp ext3_ready $? "$(grep -c JIT $R/ext3.log) JIT builds") &
ext=$!
python3 benchmarks/cost_growth.py $W --shape 8b --make > $R/make.log 2>&1
stamp made_8b $? "$(du -sh $W/llama-8b | cut -f1)"
wait $ext
python3 benchmarks/cost_growth.py $W --shape 8b --label exl3 -- --exl3 4.0 > $R/8b-exl3.log 2>&1
stamp 8b_exl3 $?
cp benchmarks/results/cost_growth.json $R/ 2>/dev/null
stamp done
