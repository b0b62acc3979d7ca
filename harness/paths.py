"""Where the project's files are: defined once for the harness, the benches and the notebooks."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = PROJECT_ROOT / "topologies"
SCENARIOS = PROJECT_ROOT / "scenarios"
CI_SCENARIOS = SCENARIOS / "ci"
RESULTS = PROJECT_ROOT / "results"
RUNS_ROOT = RESULTS / "runs"          # run output (git-ignored)
REPORTS_ROOT = RESULTS / "reports"    # reports over several runs
BASELINES = RESULTS / "baselines"     # CI regression baselines (committed)
BENCH_RESULTS = RESULTS / "bench"     # benchmark tables quoted in docs/RESULTS.md (committed)
