"""--branch commits exactly the defaults edit and the report; --open-pr runs gh or prints the exact commands."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import DEFAULT_POLICY, DEFAULTS, REPO
from promote_sim import Sim, moe, simulate
from ruamel.yaml import YAML

from ablate.config.schema import ConfigError
from ablate.promote import Policy, make_branch, promote, write_defaults
from ablate.receipts.store import seal


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
    plots = [f for f in committed if f.startswith(f"reports/promotions/{result.report_id}/")]
    assert plots and all(f.endswith(".png") for f in plots)  # the trade-off plot the PR body links to
    assert f"]({result.report_id}/" in (repo / md).read_text()
    assert sorted(committed) == sorted(["search_spaces/defaults.yaml", md, f"reports/promotions/"
                                                                          f"{result.report_id}.json", *plots])
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


def test_promote_write_branch_counts_values_and_leaves_one_report(repo: Path, tmp_path: Path) -> None:
    # `ablate promote --write --branch` as a user runs it: one promoted value, one committed report.
    receipts = tmp_path / "receipts.jsonl"
    # Sealed, as every writer seals a receipt (a 2.1+ receipt without its digest is refused).
    receipts.write_text("".join(seal(r).model_dump_json() + "\n" for r in simulate(
        Sim(features=[moe(1.05)], noise=0.007, aa_per_host=2), 0)))
    data = YAML(typ="safe").load(DEFAULT_POLICY.read_text())
    data["bootstrap"].update(resamples=2000, loss_resamples=500)  # as the `policy` fixture: fast
    data["scope"]["global_device_classes"] = []  # simulated arms are CPU arms; this test is about the write
    policy_file = tmp_path / "policy.yaml"
    with policy_file.open("w") as handle:
        YAML(typ="safe").dump(data, handle)
    git(repo, "reset", "--quiet")  # nothing staged: the working tree must end clean apart from unrelated.txt
    out = subprocess.run([sys.executable, "-m", "ablate", "promote", "--source", str(receipts), "--policy",
                          str(policy_file), "--write", "--branch", "promote/moe"], cwd=repo, capture_output=True,
                         text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                                                      "HOME": str(tmp_path), "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "defaults: 1 value(s) promoted (2 edit(s))" in out.stdout  # one flip + its evidence: one value
    assert git(repo, "branch", "--show-current") == "promote/moe"
    reports = sorted(str(p.relative_to(repo)) for p in (repo / "reports").rglob("*") if p.is_file())
    committed = git(repo, "show", "--name-only", "--format=", "HEAD").splitlines()
    assert reports == sorted(f for f in committed if f.startswith("reports/"))  # the committed copy only
    assert sorted({f.rsplit(".", 1)[1] for f in reports}) == ["json", "md", "png"]  # report + its trade-off plot
    assert git(repo, "status", "--porcelain") == "?? unrelated.txt"


@pytest.fixture(scope="module")
def cli_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Sealed receipts of a campaign that promotes moe_dispatch=jagged, and a fast policy that lets CPU arms
    flip it globally."""
    tmp = tmp_path_factory.mktemp("cli_inputs")
    receipts = tmp / "receipts.jsonl"
    receipts.write_text("".join(seal(r).model_dump_json() + "\n" for r in simulate(
        Sim(features=[moe(1.05)], noise=0.007, aa_per_host=2), 0)))
    data = YAML(typ="safe").load(DEFAULT_POLICY.read_text())
    data["bootstrap"].update(resamples=2000, loss_resamples=500)
    data["scope"]["global_device_classes"] = []
    policy_file = tmp / "policy.yaml"
    with policy_file.open("w") as handle:
        YAML(typ="safe").dump(data, handle)
    return receipts, policy_file


def _promote_cli(repo: Path, cli_inputs: tuple[Path, Path], *args: str) -> subprocess.CompletedProcess[str]:
    receipts, policy_file = cli_inputs
    return subprocess.run([sys.executable, "-m", "ablate", "promote", "--source", str(receipts), "--policy",
                           str(policy_file), *args], cwd=repo, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(repo.parent),
                               "COLUMNS": "200"})


@pytest.mark.parametrize("write", [False, True], ids=["branch", "write-branch"])
def test_a_refused_branch_name_writes_nothing(repo: Path, cli_inputs: tuple[Path, Path], write: bool) -> None:
    git(repo, "reset", "--quiet")
    git(repo, "branch", "promote/moe")  # last week's promotion branch
    for name, allowed in (("promote/moe", "branch 'promote/moe' already exists"),
                          ("bad..name", "a valid git branch name")):
        out = _promote_cli(repo, cli_inputs, *(["--write"] if write else []), "--branch", name)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith(f"error: --branch: got {name!r}; allowed: ")
        assert allowed in out.stderr and "Traceback" not in out.stderr
        # Nothing written: not the defaults on the branch the user is on, not a report.
        assert git(repo, "status", "--porcelain") == "?? unrelated.txt"
        assert git(repo, "branch", "--show-current") == "main"


def test_branch_without_write_edits_the_defaults_on_the_new_branch_only(repo: Path,
                                                                       cli_inputs: tuple[Path, Path]) -> None:
    git(repo, "reset", "--quiet")
    out = _promote_cli(repo, cli_inputs, "--branch", "promote/moe")
    assert out.returncode == 0, out.stderr
    assert "defaults: 1 value(s) promoted (2 edit(s))" in out.stdout and "on branch promote/moe" in out.stdout
    assert "value: jagged" in git(repo, "show", "promote/moe:search_spaces/defaults.yaml")
    assert "value: jagged" not in git(repo, "show", "main:search_spaces/defaults.yaml")
    assert git(repo, "status", "--porcelain") == "?? unrelated.txt"


LOCAL_EDIT = ("    value: sequential    # reference SSD recurrence", "    value: chunked       # trying this locally")


def test_local_edits_to_the_defaults_refuse_the_branch(policy: Policy, repo: Path) -> None:
    defaults = repo / "search_spaces" / "defaults.yaml"
    assert LOCAL_EDIT[0] in defaults.read_text()
    edited = defaults.read_text().replace(*LOCAL_EDIT)
    defaults.write_text(edited)  # a hand edit of another feature, not committed
    result = promote(simulate(Sim(features=[moe(1.05)], noise=0.007, aa_per_host=2), 0), policy_path=policy,
                     defaults_path=defaults)
    with pytest.raises(ConfigError, match="search_spaces/defaults.yaml: it has uncommitted local edits.*commit or "
                                          "stash them"):
        make_branch(result, "promote/moe", repo)
    assert defaults.read_text() == edited  # neither promoted nor reverted
    assert git(repo, "branch", "--show-current") == "main" and git(repo, "branch", "--list", "promote/moe") == ""
    git(repo, "stash", "--quiet")  # as the error says
    # That result was decided against the edited file: written over another one it is refused, before any branch.
    with pytest.raises(ConfigError, match="changed since this promotion read it"):
        make_branch(result, "promote/moe", repo)
    assert git(repo, "branch", "--show-current") == "main" and git(repo, "branch", "--list", "promote/moe") == ""
    # Decided again on the file as it is now, the promotion commits only its own edit.
    result = promote(simulate(Sim(features=[moe(1.05)], noise=0.007, aa_per_host=2), 0), policy_path=policy,
                     defaults_path=defaults)
    outcome = make_branch(result, "promote/moe", repo)
    diff = git(repo, "show", outcome.commit, "--", "search_spaces/defaults.yaml")
    assert "+    value: jagged" in diff and "chunked" not in diff


def test_write_branch_with_local_edits_is_refused_before_the_write(repo: Path, cli_inputs: tuple[Path, Path]) -> None:
    git(repo, "reset", "--quiet")
    defaults = repo / "search_spaces" / "defaults.yaml"
    edited = defaults.read_text().replace(*LOCAL_EDIT)
    defaults.write_text(edited)
    out = _promote_cli(repo, cli_inputs, "--write", "--branch", "promote/moe")
    assert out.returncode == 2, out.stderr
    assert "error: --branch: got 'promote/moe'" in out.stderr and "commit or stash them first" in out.stderr
    assert defaults.read_text() == edited and git(repo, "branch", "--list", "promote/moe") == ""
    assert not (repo / "reports").exists()


def _refused_commits(repo: Path, policy: Policy) -> tuple[Path, Any]:
    """The user's pre-commit hook refuses every commit; the defaults file and a promotion decided on it."""
    hook = repo / ".git" / "hooks" / "pre-commit"
    hook.write_text("#!/bin/sh\necho 'refused by the test hook' >&2\nexit 1\n")
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    defaults = repo / "search_spaces" / "defaults.yaml"
    return defaults, promote(simulate(Sim(features=[moe(1.05)], noise=0.007, aa_per_host=2), 0), policy_path=policy,
                             defaults_path=defaults)


@pytest.mark.parametrize("written_first", [False, True], ids=["branch", "write-then-branch"])
def test_a_commit_that_fails_on_the_new_branch_leaves_everything_as_it_was(policy: Policy, repo: Path,
                                                                           written_first: bool) -> None:
    """A failure after the branch is made (here the user's pre-commit hook refuses the commit) undoes it: back on
    the branch it started from, the new branch gone, the defaults file as it was (``--write``'s edit kept, nothing
    of it staged), no report file left, the user's own staged work still staged (found in review: the user was
    left on an empty branch with the promoted defaults staged, which a switch back carried over)."""
    defaults, result = _refused_commits(repo, policy)
    if written_first:
        assert write_defaults(result, defaults)
        git(repo, "add", "search_spaces/defaults.yaml")  # the user staged what --write wrote: it stays staged
    before = defaults.read_text()
    staged = git(repo, "ls-files", "--stage")
    with pytest.raises(RuntimeError, match="refused by the test hook"):
        make_branch(result, "promote/moe", repo)
    assert git(repo, "branch", "--show-current") == "main" and git(repo, "branch", "--list", "promote/moe") == ""
    assert defaults.read_text() == before
    assert git(repo, "ls-files", "--stage") == staged
    assert git(repo, "diff", "--cached", "--name-only").splitlines() == (
        ["search_spaces/defaults.yaml", "unrelated.txt"] if written_first else ["unrelated.txt"])
    assert not (repo / "reports").exists()  # made by the promotion, and gone with it


def test_the_undo_keeps_a_report_folder_that_was_there(policy: Policy, repo: Path) -> None:
    """An earlier ``promote --out reports/promotions`` of the same receipts left this report id's plot folder: a
    failed promotion on its branch puts its files back as they were and stages none of them on the user's branch
    (found in review: the plots stayed staged on main)."""
    _, result = _refused_commits(repo, policy)
    folder = repo / "reports" / "promotions" / result.report_id
    plots = result.write_plots(folder, relative_to=folder.parent)
    assert plots
    for plot in plots.values():
        Path(plot).write_bytes(b"an earlier run's plot")
    (folder / "notes.txt").write_text("the user's own file\n")
    before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
    with pytest.raises(RuntimeError, match="commit"):
        make_branch(result, "promote/moe", repo)
    assert git(repo, "branch", "--show-current") == "main" and git(repo, "branch", "--list", "promote/moe") == ""
    assert git(repo, "diff", "--cached", "--name-only") == "unrelated.txt"
    assert {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()} == before
    assert not (folder.parent / f"{result.report_id}.md").exists()


@pytest.mark.parametrize("rule", ["reports/", "*.png", "*.json"])
def test_a_repository_that_ignores_the_report_is_refused_before_the_branch(policy: Policy, repo: Path,
                                                                           rule: str) -> None:
    (repo / ".gitignore").write_text(f"{rule}\n")
    defaults = repo / "search_spaces" / "defaults.yaml"
    before = defaults.read_text()
    result = promote(simulate(Sim(features=[moe(1.05)], noise=0.007, aa_per_host=2), 0), policy_path=policy,
                     defaults_path=defaults)
    with pytest.raises(ConfigError, match="does not ignore reports/promotions/ or the .md, .json and .png"):
        make_branch(result, "promote/moe", repo)
    assert git(repo, "branch", "--show-current") == "main" and git(repo, "branch", "--list", "promote/moe") == ""
    assert defaults.read_text() == before
