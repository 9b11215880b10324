"""``--branch`` / ``--open-pr``: commit the defaults edit and the report on a new git branch, then open a PR.

How to use: ``make_branch(result, "promote/moe-jagged", repo_root=".", open_pr=True)``. The branch is created
from the current HEAD with ``git switch -c`` (the working tree stays on it afterwards); only the defaults file
and the two report files are committed, whatever else is staged; the report under ``reports/promotions/`` is
the only copy (``ablate promote --branch`` writes none to ``--out``). Before it switches or writes anything it
refuses (``check_branch``: a ``ConfigError`` naming ``--branch``) a name that is taken or invalid, and a defaults
file with uncommitted edits of its own, which the commit would carry. With ``open_pr`` the branch is pushed and
``gh pr create`` is run when ``gh`` is on PATH; otherwise the exact commands are returned (and printed by the
CLI) so a person can run them.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ablate.config.schema import ConfigError
from ablate.promote.defaults_writer import check_unchanged, render_defaults, write_defaults
from ablate.promote.report import PromotionResult

REPORT_DIR = Path("reports") / "promotions"


@dataclass
class BranchOutcome:
    branch: str
    base: Optional[str]
    commit: str
    files: list[str]
    edits: list[str]
    pr_commands: list[str] = field(default_factory=list)
    """The push and ``gh pr create`` commands, shell-quoted."""
    pr_opened: bool = False
    pr_output: str = ""
    report: str = ""
    """The committed Markdown report, relative to the repository root (the only copy ``promote`` leaves)."""


def _git(repo: Path, *args: str, check: bool = True, stdin: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["git", *args], cwd=repo, input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _title(result: PromotionResult) -> str:
    # From the changes the writer makes: a PROMOTE verdict whose shape's lanes disagree changes nothing.
    promoted = [f"{c.feature}={c.new}" for c in result.changes if c.scope == "global"]
    promoted += [f"{c.feature}={value} (lane)" for c in result.changes if c.scope != "global"
                 for value in sorted({str(v) for v in c.overrides.values()})]
    if promoted:
        title = f"promote: {', '.join(promoted[:4])}{' …' if len(promoted) > 4 else ''} ({result.campaign})"
    else:
        title = f"promotion report {result.report_id} (no change)"
    # A commit subject and a PR title are one line: nothing from a receipt may start a second one.
    return " ".join(title.split())


def pr_commands(result: PromotionResult, branch: str, base: Optional[str], body_file: str) -> list[list[str]]:
    create = ["gh", "pr", "create", "--title", _title(result), "--body-file", body_file, "--head", branch]
    if base:
        create += ["--base", base]
    return [["git", "push", "--set-upstream", "origin", branch], create]


def check_branch_name(branch: str, repo_root: str | Path) -> Path:
    """The checks that need no result (a git work tree, a valid and new branch name), so ``ablate promote
    --branch`` refuses before reading any receipt; returns the work tree's root."""
    repo = Path(repo_root).resolve()
    if _git(repo, "rev-parse", "--is-inside-work-tree", check=False).returncode != 0:
        raise ConfigError("--branch", branch, f"a new branch name, run inside a git work tree ({repo} is not in "
                                              f"one)")
    if _git(repo, "check-ref-format", "--branch", branch, check=False).returncode != 0:
        raise ConfigError("--branch", branch, "a valid git branch name (see `git check-ref-format --branch`)")
    if _git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False).returncode == 0:
        raise ConfigError("--branch", branch, f"a name no branch has yet: branch {branch!r} already exists")
    return repo


def _defaults_file(result: PromotionResult, repo: Path) -> Path:
    path = Path(result.defaults_path)
    if not path.is_absolute():
        path = (repo / path) if (repo / path).exists() else path.resolve()
    # A symlinked defaults file is committed as its target, which is what the writer edits.
    return path.resolve()


def check_branch(result: PromotionResult, branch: str, repo_root: str | Path) -> Path:
    """Every check ``make_branch`` makes before it switches branch or writes anything; returns the defaults file.

    The commit takes the defaults file as it is in the work tree, so that file must be HEAD's content, or exactly
    what the writer makes of HEAD's content for this result (``--write --branch`` wrote it already): any other
    difference is a local edit that would ride along in the promotion commit and its PR, unmentioned.
    """
    repo = check_branch_name(branch, repo_root)
    defaults_path = _defaults_file(result, repo)
    toplevel = Path(_git(repo, "rev-parse", "--show-toplevel").stdout.strip()).resolve()
    try:
        defaults_rel = defaults_path.relative_to(toplevel).as_posix()
    except ValueError:
        raise ConfigError("--defaults", str(defaults_path), f"a file inside the git work tree {toplevel}, for "
                                                            f"--branch to commit it") from None
    head = _git(repo, "show", f"HEAD:{defaults_rel}", check=False)
    if head.returncode != 0:
        raise ConfigError("--branch", branch, f"a branch cut from a HEAD that has {defaults_rel}: it is not "
                                              f"committed; commit it first")
    # Every kind of file the commit adds (a repository ignoring *.png or *.json is common): git add refuses any.
    kinds = [REPORT_DIR / f"{result.report_id}.md", REPORT_DIR / f"{result.report_id}.json",
             REPORT_DIR / result.report_id / "plot.png"]
    ignored = _git(repo, "check-ignore", "--", *map(str, kinds), check=False)  # 0: one of them or more
    if ignored.returncode == 0:
        raise ConfigError("--branch", branch, f"a repository that does not ignore {REPORT_DIR.as_posix()}/ or the "
                                              f".md, .json and .png files the report is committed as (a .gitignore "
                                              f"rule matches them)")
    working = defaults_path.read_text()
    check_unchanged(result, working, defaults_path)  # before the branch is made: nothing half-done on a refusal
    if working != head.stdout and working != render_defaults(head.stdout, result)[0]:
        raise ConfigError("--branch", branch, f"a branch cut from a clean {defaults_rel}: it has uncommitted local "
                                              f"edits, which would ride along in the promotion commit; commit or "
                                              f"stash them first")
    return defaults_path


@dataclass
class _Written:
    """What a promotion on its new branch wrote, so that a failure can put it back (``_undo_branch``)."""

    repo: Path
    files: dict[Path, Optional[bytes]] = field(default_factory=dict)
    """Each file before it was written: its bytes, or None where there was none."""
    staged: dict[Path, str] = field(default_factory=dict)
    """Each claimed file's index entry before (``git ls-files --stage``), where it had one: the user's own staged
    copy is put back as it was, not reset to HEAD (found in review)."""
    folders: list[Path] = field(default_factory=list)
    """Folders made here (none of them was there before), outermost first."""
    kept: list[Path] = field(default_factory=list)
    """Folders that were there already: a file in them that is not in ``files`` was added here."""

    def claim(self, path: Path) -> Path:
        if path not in self.files:
            self.files[path] = path.read_bytes() if path.is_file() else None
            entry = _git(self.repo, "ls-files", "--stage", "--", str(path), check=False).stdout.strip()
            if entry:
                self.staged[path] = entry
        return path

    def make(self, folder: Path) -> None:
        for made in reversed([folder, *folder.parents]):
            if made.is_relative_to(self.repo) and made != self.repo and not made.exists():
                self.folders.append(made)
        folder.mkdir(parents=True, exist_ok=True)


def _commit_promotion(result: PromotionResult, repo: Path, defaults_path: Path, written: _Written
                      ) -> tuple[list[str], list[str], Path]:
    """Defaults, report and plots written and committed on the branch just made: (edits, files, the Markdown).
    Every path is claimed in ``written`` before it is written."""
    written.claim(defaults_path)
    edits = write_defaults(result, defaults_path)
    report_dir = repo / REPORT_DIR
    written.make(report_dir)
    md_path = written.claim(report_dir / f"{result.report_id}.md")
    json_path = written.claim(report_dir / f"{result.report_id}.json")
    # The trade-off plots sit next to the report, so its relative image links work in the pull request. A folder
    # of this report id may be there already (an earlier `promote --out reports/promotions` of the same receipts).
    plot_dir = report_dir / result.report_id
    if plot_dir.is_dir():
        written.kept.append(plot_dir)
        for existing in sorted(plot_dir.rglob("*")):
            if existing.is_file():
                written.claim(existing)
    written.make(plot_dir)
    plots = list(result.write_plots(plot_dir, relative_to=report_dir).values())
    md_path.write_text(result.markdown)
    json_path.write_text(result.to_json() + "\n")

    files = [str(p.resolve().relative_to(repo)) for p in (*plots, md_path, json_path)]
    defaults_rel = str(defaults_path.resolve().relative_to(repo))
    # The defaults may already have been written (`--write --branch`): commit them whenever they differ.
    if edits or _git(repo, "diff", "--quiet", "HEAD", "--", defaults_rel, check=False).returncode != 0:
        files.insert(0, defaults_rel)
    _git(repo, "add", "--", *files)
    message = f"{_title(result)}\n\nReport {result.report_id} under policy {result.policy.ref}.\n"
    # `commit -- paths` commits exactly these files even when the user has other changes staged.
    _git(repo, "commit", "--quiet", "-m", message, "--", *files)
    return edits, files, md_path


def _undo_branch(repo: Path, branch: str, back_to: str, detached: bool, written: _Written) -> None:
    """A promotion that failed on its new branch (a refused commit, a full disk, an interrupt) leaves the user
    where they were: what it staged unstaged (the user's own staged work stays), its files as they were, the
    folders it made gone, back on the branch it started from, the new branch deleted. Found in review: the user was
    left on an empty branch with the promoted defaults staged, which a switch back carried onto their branch. Each
    step is tried whatever the others do."""

    def relative(path: Path) -> str:
        return str(path.resolve().relative_to(repo))

    added = [path for folder in written.kept for path in folder.rglob("*")
             if path.is_file() and path not in written.files]
    # The index first: each claimed file's entry as it was (the user's staged copy, or HEAD's), none where it had
    # none; whatever was added under the folders goes from the index.
    steps: list[Any] = [lambda line=line: _git(repo, "update-index", "--index-info", stdin=line + "\n")
                        for line in written.staged.values()]
    steps += [lambda path=path: _git(repo, "rm", "--cached", "--quiet", "--ignore-unmatch", "-r", "--",
                                     relative(path))
              for path in [*(p for p in written.files if p not in written.staged), *added, *written.folders]]
    for path, content in written.files.items():
        steps.append(lambda path=path, content=content: path.write_bytes(content) if content is not None
                     else path.unlink(missing_ok=True))
    steps += [lambda path=path: path.unlink(missing_ok=True) for path in added]
    # A folder made here holds only what this promotion wrote (a plot written before the failure included).
    steps += [lambda folder=folder: shutil.rmtree(folder) for folder in written.folders]
    steps += [lambda: _git(repo, "switch", "--quiet", *(("--detach",) if detached else ()), back_to),
              lambda: _git(repo, "branch", "--quiet", "-D", branch)]
    for step in steps:
        with contextlib.suppress(Exception):
            step()


def make_branch(result: PromotionResult, branch: str, repo_root: str | Path, open_pr: bool = False) -> BranchOutcome:
    """Create ``branch``, write defaults + report, commit them; optionally push and open the PR. Refuses
    (``ConfigError``, nothing written, no branch made) when ``check_branch`` does."""
    repo = Path(repo_root).resolve()
    defaults_path = check_branch(result, branch, repo)
    head = _git(repo, "symbolic-ref", "--quiet", "--short", "HEAD", check=False)
    base = head.stdout.strip() or None
    start = _git(repo, "rev-parse", "HEAD").stdout.strip()
    _git(repo, "switch", "-c", branch)
    written = _Written(repo=repo)
    try:
        edits, files, md_path = _commit_promotion(result, repo, defaults_path, written)
    except BaseException:
        _undo_branch(repo, branch, base or start, base is None, written)
        raise
    commit = _git(repo, "rev-parse", "HEAD").stdout.strip()

    outcome = BranchOutcome(branch=branch, base=base, commit=commit, files=files, edits=edits,
                            report=str(md_path.resolve().relative_to(repo)))
    if open_pr:
        commands = pr_commands(result, branch, base, files[-2])
        outcome.pr_commands = [shlex.join(c) for c in commands]
        if shutil.which("gh"):
            outputs = []
            for command in commands:
                proc = subprocess.run(command, cwd=repo, capture_output=True, text=True)
                outputs.append((proc.stdout + proc.stderr).strip())
                if proc.returncode != 0:
                    raise RuntimeError(f"{shlex.join(command)} failed ({proc.returncode}): {outputs[-1]}")
            outcome.pr_opened, outcome.pr_output = True, "\n".join(outputs)
    return outcome
