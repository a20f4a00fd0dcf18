#!/bin/bash
# Once a sitting has built exllamav2's and exllamav3's extensions (TORCH_EXTENSIONS_DIR=/tmp/torch_ext), their
# .so files to $OUT in 15 MiB pieces (the device returns files of up to 16 MiB, 8 a call). Here: `cat` the pieces
# of each into .ext/ (git-ignored), carry .ext, and put it first on PYTHONPATH: both packages import a precompiled
# exllamav2_ext / exllamav3_ext from the path before building one (their ext.py).
mkdir -p $OUT
for so in /tmp/torch_ext/exllamav2_ext/exllamav2_ext.so /tmp/torch_ext/exllamav3_ext/exllamav3_ext.so; do
    [ -f "$so" ] || { echo "no $so"; continue; }
    ls -la "$so"; strip --strip-debug -o /tmp/$(basename $so) "$so" && ls -la /tmp/$(basename $so)
    split -b 15M -d /tmp/$(basename $so) $OUT/$(basename $so .so).part
done
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
ls -la $OUT
