#!/bin/bash
# The 8B's third sitting (issue 44): drive2.sh's three jobs again, after the two mends its run called for (jobs of one
# source share one snapshot, so the disk holds the source twice, not four times; AWQ-CT sums its losses in float32),
# and with the EXL2 measurement now in layer ranges measured at once (issue 47, factory/engines/exl2/ranges.py).
# exllamav3's build is the critical chain's first link (435 s with 8 jobs beside exllamav2's in sitting 2; its job
# about 1090 s after), so it gets most of the 16 cores.
# Start as drive2.sh (report.sh polls it), carrying .whl and .commit:
#   cp -a . /tmp/repo && cd /tmp/repo && setsid nohup bash benchmarks/results/gpu-2026-12-06/drive3.sh &
EXL2_JOBS=4 EXL3_JOBS=14 exec bash /tmp/repo/benchmarks/results/gpu-2026-12-06/drive2.sh
