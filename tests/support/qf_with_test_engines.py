"""`qf` with the test engines of tests/support/round_engine.py registered, for tests that run it as a real process:
python -m tests.support.qf_with_test_engines run SOURCE --recipe R.yaml ..."""

from factory import engines
from factory.cli import main
from tests.support.round_engine import ENGINE, MEASURED

if __name__ == "__main__":
    engines.register(ENGINE)
    engines.register(MEASURED)
    main()
