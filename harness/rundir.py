"""One run directory, read once: the files `wanbench run` wrote (layout: harness/run.py).

`RunDir(path)` reads nothing until asked; each file is then read once and kept: scenario.json,
environment.json, the COMPLETE and INTERRUPTED markers, each network point's plan.json, and per
job (`JobDir`) job.json, config.json, its ranks' records, eval.jsonl, faults.jsonl and wire.json.
harness/results.py turns a RunDir into frames (`run_frames`) and harness/report.py takes the rest
(the environment, how K was chosen, the plans' axes) from the same object, so a report reads
every file of a run once.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cached_property
from pathlib import Path
from typing import Optional

from emulator.schema import ConfigError
from trainers.jsonl import read_complete_records

from .scenario import NetworkPoint

SCENARIO_FILE = "scenario.json"
EVAL_FILE = "eval.jsonl"     # the evaluator's records (trainers/evaluate.py)
FAULTS_FILE = "faults.jsonl"  # the harness's fault events (harness/faults.py)
WIRE_FILE = "wire.json"      # bytes each node put on the wire (harness/jobs.py)
TUNING_FILE = "tuning.json"   # a tuning protocol's grid, rule and picks (harness/tuning.py)


def read_json_object(path: Path) -> dict:
    """A JSON object file, or {} when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class JobDir:
    """One job's folder, `<run>/jobs/<job-id>/`, each file read on first use."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def job_id(self) -> str:
        return self.path.name

    @cached_property
    def info(self) -> dict:
        """job.json, or {"status": "incomplete"} for a job that never wrote it."""
        path = self.path / "job.json"
        return json.loads(path.read_text()) if path.exists() else {"status": "incomplete"}

    @cached_property
    def config(self) -> Optional[dict]:
        """config.json, the trainers' input (None when missing or unreadable)."""
        try:
            return json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError):
            return None

    @cached_property
    def rank_records(self) -> list[tuple[Path, list[dict]]]:
        """(file, records) of every rank<N>.jsonl, in file-name order; a torn line left out."""
        return [(path, read_complete_records(path)) for path in sorted(self.path.glob("rank*.jsonl"))]

    @cached_property
    def evals(self) -> list[dict]:
        """The evaluator's eval records (eval.jsonl; [] in runs made before it)."""
        return read_complete_records(self.path / EVAL_FILE, kinds=("eval",))

    @cached_property
    def faults(self) -> list[dict]:
        """The harness's fault records (faults.jsonl; [] for a job without faults)."""
        return read_complete_records(self.path / FAULTS_FILE, kinds=("fault",))

    @cached_property
    def wire(self) -> dict:
        """wire.json: what each node and each pair of nodes put on the emulated wire during the job
        (the backend's counters); {} where the backend keeps no counters."""
        try:
            return json.loads((self.path / WIRE_FILE).read_text())
        except (OSError, ValueError):
            return {}

    @property
    def wire_bytes_by_rank(self) -> dict:
        """Bytes each rank's node put on the emulated wire during the job; {} without wire.json.
        Entries without a rank (older files) are keyed by node name."""
        nodes = self.wire.get("nodes") or {}
        return {node.get("rank", name): node["bytes_sent"] for name, node in nodes.items()}

    @property
    def network_key(self) -> str:
        """The network point the job is compared at (job.json; "" without it)."""
        return self.info.get("network_key", "")

    @property
    def network_folder(self) -> Optional[str]:
        """The run's folder of the network the job ran on (its plan.json); None without job.json."""
        return _folder(self.info.get("network"))


def _folder(network) -> Optional[str]:
    """NetworkPoint.folder of a saved network point (a dict of its fields), None if not one."""
    if not isinstance(network, dict):
        return None
    known = {f.name for f in dataclasses.fields(NetworkPoint)}
    try:
        return NetworkPoint(**{k: v for k, v in network.items() if k in known}).folder
    except (TypeError, ValueError):
        return None


class RunDir:
    """A run directory, each file read on first use and kept (see the module docstring).

    Args:
        path: the run directory (results/runs/<scenario>/<run-id>).
    """

    def __init__(self, path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @cached_property
    def scenario(self) -> dict:
        """scenario.json; ConfigError naming the file when it is missing or not JSON."""
        try:
            text = (self.path / SCENARIO_FILE).read_text()
        except OSError:
            raise ConfigError("", "not a run directory (no scenario.json); give results/runs/<scenario>/<run-id>",
                              source=str(self.path)) from None
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ConfigError(SCENARIO_FILE, f"not valid JSON ({exc})", source=str(self.path)) from None

    @property
    def spec(self) -> dict:
        return self.scenario.get("spec", {})

    @property
    def stop(self) -> dict:
        return self.spec.get("stop") or {}

    @property
    def time_dilation(self) -> float:
        return float(self.spec.get("time_dilation") or 1.0)

    @property
    def time_dilation_auto(self) -> Optional[dict]:
        """How time_dilation: auto chose K (None when K was given)."""
        auto = self.scenario.get("time_dilation_auto")
        return auto if isinstance(auto, dict) else None

    @property
    def sim(self) -> Optional[dict]:
        """Backend sim: the compute model and NIC (None on an emulated network)."""
        sim = self.scenario.get("sim")
        return sim if isinstance(sim, dict) else None

    @cached_property
    def tuning(self) -> Optional[dict]:
        """tuning.json (the grid, the rule and each label's pick), None for a run without tuning."""
        path = self.path / TUNING_FILE
        return (read_json_object(path) or None) if path.is_file() else None

    @cached_property
    def environment(self) -> dict:
        """environment.json ({} when missing or unreadable)."""
        return read_json_object(self.path / "environment.json")

    @property
    def complete(self) -> bool:
        return (self.path / "COMPLETE").exists()

    @cached_property
    def interrupted(self) -> str:
        """The first line of INTERRUPTED (why a signal or an error ended the run); "" without it."""
        path = self.path / "INTERRUPTED"
        if not path.is_file():
            return ""
        lines = path.read_text(errors="replace").strip().splitlines()[:1]
        return lines[0] if lines else "no reason recorded"

    @cached_property
    def plans(self) -> dict[str, dict]:
        """Network folder -> its plan.json (folders whose plan is not JSON left out)."""
        plans = {}
        for plan_path in sorted(self.path.glob("*/plan.json")):
            try:
                plans[plan_path.parent.name] = json.loads(plan_path.read_text())
            except ValueError:
                continue
        return plans

    @cached_property
    def jobs(self) -> list[JobDir]:
        """Every job folder, in name order."""
        jobs_dir = self.path / "jobs"
        return [JobDir(path) for path in sorted(jobs_dir.glob("*"))] if jobs_dir.is_dir() else []

    def network_key_of_folder(self, folder: str) -> str:
        """The network point a network folder is compared at: the `network_key` of a job that ran
        there (job.json), else of a job the scenario put there (scenario.json), else the folder's name."""
        for job in self.jobs:
            if job.network_folder == folder and job.network_key:
                return job.network_key
        for job in self.scenario.get("jobs") or []:
            network = job.get("network") if isinstance(job, dict) else None
            if _folder(network) == folder:
                known = {f.name for f in dataclasses.fields(NetworkPoint)}
                return NetworkPoint(**{k: v for k, v in network.items() if k in known}).key
        return folder
