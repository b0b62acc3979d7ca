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
