"""--branch commits exactly the defaults edit and the report; --open-pr runs gh or prints the exact commands."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from conftest import DEFAULTS
from promote_sim import Sim, moe, simulate

from ablate.promote import Policy, make_branch, promote, write_defaults


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "search_spaces").mkdir(parents=True)
    shutil.copy(DEFAULTS, root / "search_spaces" / "defaults.yaml")
    git(root, "init", "--quiet", "--initial-branch=main")
    git(root, "config", "user.email", "promote@test")
    git(root, "config", "user.name", "promote test")
    git(root, "add", ".")
    git(root, "commit", "--quiet", "-m", "init")
    (root / "unrelated.txt").write_text("work in progress\n")
    git(root, "add", "unrelated.txt")  # staged by the user: must not end up in the promotion commit
    return root


def test_branch_commits_defaults_and_report_only(policy: Policy, repo: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no gh here
    assert shutil.which("gh") is None
    defaults = repo / "search_spaces" / "defaults.yaml"
    result = promote(simulate(Sim(features=[moe(1.05)], noise=0.007, aa_per_host=2), 0), policy_path=policy,
                     defaults_path=defaults)
    write_defaults(result, defaults)  # as `ablate promote --write --branch` does before make_branch
    outcome = make_branch(result, "promote/moe-jagged", repo, open_pr=True)
    assert outcome.edits == []  # already written: nothing twice, yet the defaults file is committed
    assert git(repo, "branch", "--show-current") == "promote/moe-jagged" and outcome.base == "main"
    committed = git(repo, "show", "--name-only", "--format=", "HEAD").splitlines()
    md = f"reports/promotions/{result.report_id}.md"
    assert sorted(committed) == sorted(["search_spaces/defaults.yaml", md, f"reports/promotions/"
                                                                          f"{result.report_id}.json"])
    assert "value: jagged" in git(repo, "show", "HEAD:search_spaces/defaults.yaml")
    assert git(repo, "show", f"HEAD:{md}") == result.markdown.strip()
    assert "A  unrelated.txt" in git(repo, "status", "--porcelain")  # still staged, not committed
    assert not outcome.pr_opened
    assert outcome.pr_commands == [
        "git push --set-upstream origin promote/moe-jagged",
        f"gh pr create --title 'promote: moe_dispatch=jagged (sim)' --body-file {md} --head promote/moe-jagged "
        "--base main"]
    with pytest.raises(ValueError, match="already exists"):
        make_branch(result, "promote/moe-jagged", repo)


def test_open_pr_runs_gh_when_installed(policy: Policy, repo: Path, monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    remote = tmp_path / "origin.git"
    subprocess.run(["git", "init", "--quiet", "--bare", str(remote)], check=True)
    git(repo, "remote", "add", "origin", str(remote))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_gh = bin_dir / "gh"
    fake_gh.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'gh-args'}\necho https://github.test/pr/1\n")
    fake_gh.chmod(fake_gh.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin:/bin")
    result = promote(simulate(Sim(features=[moe(1.05)], noise=0.007, aa_per_host=2), 0), policy_path=policy,
                     defaults_path=repo / "search_spaces" / "defaults.yaml")
    outcome = make_branch(result, "promote/x", repo, open_pr=True)
    assert outcome.pr_opened and "https://github.test/pr/1" in outcome.pr_output
    assert (tmp_path / "gh-args").read_text().startswith("pr create --title promote: moe_dispatch=jagged")
    assert git(remote, "rev-parse", "promote/x") == outcome.commit  # pushed before the PR was opened
