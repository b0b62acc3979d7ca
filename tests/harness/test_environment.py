"""What a run records about the code it ran (harness/environment.py)."""

import shutil
import subprocess

from harness import environment
from harness.paths import PROJECT_ROOT


def _repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    shutil.copy(PROJECT_ROOT / ".gitignore", tmp_path / ".gitignore")
    (tmp_path / "code.py").write_text("x = 1\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"],
                   check=True)
    return tmp_path


def test_a_venv_linked_into_a_worktree_leaves_the_run_clean_and_a_change_is_named(tmp_path, monkeypatch):
    """Experiments run from a detached worktree with the main checkout's .venv linked in: that link
    is ignored (a `.venv/` pattern would miss it, being a file), so the run's commit is the code;
    an edited file makes the run dirty and is named in git_changed."""
    repo = _repo(tmp_path)
    (repo / ".venv").symlink_to(PROJECT_ROOT)
    monkeypatch.setattr(environment, "PROJECT_ROOT", repo)
    assert environment.git_changes() == {"git_dirty": False, "git_changed": []}
    (repo / "code.py").write_text("x = 2\n")
    assert environment.git_changes() == {"git_dirty": True, "git_changed": ["M code.py"]}


def test_the_record_names_the_cpu_generation_and_torchs_vector_kernels(tmp_path, monkeypatch):
    """A VM's model name can be generic ("AMD EPYC" on two generations whose warm starts differed by
    0.02 nats: RESULTS 15c); the record carries family/model/stepping of the first CPU and the
    vector kernels torch chose."""
    import torch

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nstepping\t: 1\n\n"
                       "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nstepping\t: 0\n")
    real_path = environment.Path
    monkeypatch.setattr(environment, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    assert environment.cpu_id() == "family 26 model 2 stepping 1"
    record = environment.environment()
    assert record["cpu_id"] == "family 26 model 2 stepping 1" and record["cpu"] == "AMD EPYC"
    assert record["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability() != ""
