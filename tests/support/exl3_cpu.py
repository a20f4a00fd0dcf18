"""exllamav3's conversion tools on a machine without CUDA, as far as they go without a kernel: the factory's child
module MODULE (factory.engines.exl3.compat, factory.engines.exl3.optimize) run as __main__ with exllamav3's CUDA
extension replaced by one whose every function refuses to run, and its safetensors collections reading through
exllamav3's own Python loader (load_method "python") instead of the extension's C++ one.

    python -m tests.support.exl3_cpu MODULE ARG...

What runs is exllamav3's code (its optimize assembles and writes a quant: reading and copying tensors); a call into
a kernel raises RuntimeError naming it, so a test cannot pass on work the GPU would have done. The engine runs its
children this way when a test sets factory.engines.exl3.optimize.PYTHON to [python, -m, tests.support.exl3_cpu].
"""

from __future__ import annotations

import runpy
import sys
import types


class Refused(types.ModuleType):
    """exllamav3_ext: exllamav3 binds its functions at import (`ext.silu_mul`); calling any of them raises."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def refused(*args, **kwargs):
            raise RuntimeError(f"exllamav3's CUDA extension was called without a GPU: {name}")

        return refused


def main() -> None:
    ext = types.ModuleType("exllamav3.ext")
    ext.exllamav3_ext = Refused("exllamav3_ext")
    sys.modules["exllamav3.ext"] = ext
    from exllamav3.loader import safetensors

    init = safetensors.SafetensorsCollection.__init__

    def python_reads(self, directory, load_method=None, tensor_name_fixes=None):
        init(self, directory, "python", tensor_name_fixes)

    safetensors.SafetensorsCollection.__init__ = python_reads
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
