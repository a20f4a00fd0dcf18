#!/bin/bash
# The built extension, in parts of 15 MB, to carry prebuilt next session (import exllamav2_ext from /tmp/site).
mkdir -p $OUT && split -b 15000000 -d /tmp/results/exllamav2_ext.so $OUT/ext.part && sha256sum /tmp/results/exllamav2_ext.so && ls -la $OUT
