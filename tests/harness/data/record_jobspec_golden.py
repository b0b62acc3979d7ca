"""Record what the harness wrote for a small faulty scenario (a sim run with a stand-in engine, and
the tun side's dilated trainer configs and fault timeline at K = 4) before the job spec, for
tests/harness/test_jobspec.py: jobspec_golden.json was made by running this script at commit
fc659a3 (it uses that commit's API: FaultTimeline, DilatedLinks, dilated_trainer_config on the
job's dict) as `python tests/harness/data/record_jobspec_golden.py SCRATCH_DIR`."""
import io, json, sys, textwrap
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.harness.jobspec_golden import SCENARIO, TRACE, normalized_run, FAKE_ENGINE_CRASHES
import harness.jobs as jobs_module
import harness.run as run_module
from harness.scenario import load_scenario
from rich.console import Console

tmp = Path(sys.argv[1]); tmp.mkdir(parents=True, exist_ok=True)
(tmp / "trace.csv").write_text(TRACE)
(tmp / "s.yaml").write_text(SCENARIO)
script = tmp / "fake.py"; script.write_text(FAKE_ENGINE_CRASHES)
jobs_module.sim_job_argv = lambda job_dir: [sys.executable, str(script), str(job_dir)]
scenario = load_scenario(tmp / "s.yaml")
completed = run_module.run_scenario(scenario, "sim", tmp / "runs", console=Console(file=io.StringIO()))
sim = normalized_run(completed.run_dir, tmp)

# tun side: K = 4, what the ranks get and what the timeline applies
from emulator.dilation import DilatedLinks
from emulator.plan import make_plan
from harness.dilation import dilated_trainer_config
from harness.faults import FaultTimeline
tun_scn = load_scenario(tmp / "s.yaml")
k = 4.0
plan = make_plan(tun_scn.topology_for(tun_scn.network_points()[0]), time_dilation=k)
calls = []
class Rec:
    def set_link(self, s, d, spec): calls.append(["link", s, d, None if spec is None else spec.__dict__])
    def crash(self, n): calls.append(["crash", n]); return "killed"
    def restart(self, n): calls.append(["restart", n]); return "restarted"
    def set_cpu_factor(self, n, f): calls.append(["cpu", n, f]); return f"x{f}"
rec = Rec()
tl = FaultTimeline(tun_scn.spec.faults, plan.emulated_region_links(), DilatedLinks(rec, k), rec, tmp / "tunfaults.jsonl", time_dilation=k)
tl.poll(1e9)
records = [json.loads(l) for l in (tmp / "tunfaults.jsonl").read_text().splitlines()]
for r in records: r.pop("time_unix"); r.pop("applied_s")
tun = {"configs": {j.job_id: dilated_trainer_config(j.trainer_config, k) for j in tun_scn.jobs},
       "faults": records, "calls": calls}
out = Path(__file__).with_name("jobspec_golden.json")
out.write_text(json.dumps({"sim": sim, "tun_k4": tun}, indent=1, sort_keys=True) + "\n")
print("written", out, len(json.dumps(sim)), len(json.dumps(tun)))
