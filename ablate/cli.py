"""The `ablate` command line (also `python -m ablate`).

    ablate validate                       # every campaign, defaults and policy file in search_spaces/
    ablate sweep search_spaces/smoke.yaml # run a campaign (local Ray, or the cluster under `ray job submit`)
    ablate receipts list|show|sync        # receipts on disk and in MLflow
    ablate promote --write                # decide, report, update search_spaces/defaults.yaml
    ablate doctor                         # hardware, Ray, MLflow, versions

Heavy imports (torch, Ray, MLflow) happen inside the commands so `ablate validate` and `--help` stay fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ablate.config.schema import ConfigError
from ablate.redact import redact_uri

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Distributed ablation runner: does this training-speed feature really make training faster?")
receipts_app = typer.Typer(no_args_is_help=True, help="Receipts on disk and in MLflow.")
app.add_typer(receipts_app, name="receipts")
# Piped output (CI logs, `ray job logs`) gets wide lines instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

SEARCH_SPACES = Path("search_spaces")


def _fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def default_tracking_uri(explicit: Optional[str] = None) -> str:
    from ablate.tracking.uri import resolve_tracking_uri

    return resolve_tracking_uri(explicit)


# --- validate ---


def _campaign_files(paths: list[Path]) -> list[Path]:
    if paths:
        return paths
    return sorted(p for p in SEARCH_SPACES.glob("*.yaml") if p.name != "defaults.yaml")


@app.command()
def validate(paths: list[Path] = typer.Argument(None, help="Campaign files (default: search_spaces/*.yaml).")) -> None:
    """Type-check campaigns, the defaults and the promotion policies; expand every planned arm."""
    from ablate.config.load import load_defaults, load_sweep
    from ablate.sweep.plan import plan_blocks

    failures = 0
    files = _campaign_files(list(paths or []))
    if not files:
        _fail("no campaign files found")
    for path in files:
        try:
            sweep, _ = load_sweep(path)
            blocks = plan_blocks(sweep, sweep_id="validate")
            console.print(f"[green]ok[/]   {path}: {len(blocks)} blocks, {2 * len(blocks)} arms", highlight=False)
        except ConfigError as exc:
            failures += 1
            err.print(f"[red]FAIL[/] {path}: {exc}", highlight=False)
    if not paths:
        try:
            load_defaults(SEARCH_SPACES / "defaults.yaml")
            console.print(f"[green]ok[/]   {SEARCH_SPACES / 'defaults.yaml'}", highlight=False)
        except ConfigError as exc:
            failures += 1
            err.print(f"[red]FAIL[/] defaults: {exc}", highlight=False)
        failures += _validate_policies()
    if failures:
        raise typer.Exit(1)


def _validate_policies() -> int:
    from ablate.promote.policy import load_policy

    failures = 0
    for path in sorted((SEARCH_SPACES / "policies").glob("*.yaml")):
        try:
            load_policy(path)
            console.print(f"[green]ok[/]   {path}", highlight=False)
        except (ConfigError, ValueError) as exc:
            failures += 1
            err.print(f"[red]FAIL[/] {path}: {exc}", highlight=False)
    return failures


# --- sweep ---


@app.command()
def sweep(
    campaign: Path = typer.Argument(..., help="Campaign YAML, e.g. search_spaces/smoke.yaml."),
    resume: bool = typer.Option(False, "--resume", help="Continue a killed sweep; finished blocks are not rerun."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri",
                                               help="MLflow store; beats tracking.uri and $MLFLOW_TRACKING_URI (default sqlite:///<cwd>/mlflow.db)."),
    storage: Optional[str] = typer.Option(None, "--storage", help="Ray storage path (shared on multi-node)."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Run a campaign: one Ray Tune trial per block, a receipt per arm, MLflow parent + child runs."""
    from ablate.sweep.run import run_sweep

    try:
        summary = run_sweep(campaign, resume=resume, tracking_uri=tracking_uri, storage=storage, progress=progress)
    except ConfigError as exc:
        _fail(str(exc))
    console.print(summary.render())
    if summary.exit_code:
        raise typer.Exit(summary.exit_code)


# --- receipts ---


def _load_source(source: Optional[Path], tracking_uri: Optional[str], experiment: str,
                 sweep_name: Optional[list[str]]) -> tuple[list, list, dict]:
    """Receipts from a directory/JSONL (when given) or from MLflow, plus rejects and MLflow run links."""
    if source is not None:
        from ablate.receipts.store import load_receipts

        receipts, rejected = load_receipts(source)
        links: dict = {}
    else:
        from ablate.tracking.mlflow_store import load_receipts_from_mlflow

        receipts, rejected, links = load_receipts_from_mlflow(default_tracking_uri(tracking_uri), experiment)
    if sweep_name:
        keep = set(sweep_name)
        receipts = [r for r in receipts if r.identity.campaign in keep or r.identity.sweep_id in keep]
    return receipts, rejected, links


@receipts_app.command("list")
def receipts_list(
    source: Optional[Path] = typer.Option(None, "--source", help="Receipt dir / JSON / JSONL (default: MLflow)."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri"),
    experiment: str = typer.Option("ablate", "--experiment"),
    sweep_name: Optional[list[str]] = typer.Option(None, "--sweep", help="Campaign name or sweep id."),
) -> None:
    """One row per arm: block, arm, feature, status, wall tokens/s, goodput, disqualifiers."""
    receipts, rejected, _ = _load_source(source, tracking_uri, experiment, sweep_name)
    table = Table("receipt", "sweep", "block", "arm", "feature=value", "status", "wall tok/s", "goodput",
                  "disqualifiers")
    for r in sorted(receipts, key=lambda r: (r.identity.sweep_id, r.identity.block_id, r.identity.order)):
        ident = r.identity
        feature = f"{ident.feature}={ident.feature_value}" if ident.feature else "A/A"
        tps = r.throughput.wall_tokens_per_s
        table.add_row(ident.receipt_id[:8], ident.sweep_id[:12], ident.block_id, ident.arm.value, feature,
                      ident.status.value, f"{tps:.1f}" if tps else "-", f"{r.time.goodput_fraction:.1%}",
                      ",".join(sorted(r.codes())) or "-")
    console.print(table)
    for origin, reason in rejected:
        err.print(f"[yellow]rejected[/] {origin}: {reason}", highlight=False)


@receipts_app.command("show")
def receipts_show(
    receipt_id: str = typer.Argument(..., help="A receipt id or a unique prefix."),
    source: Optional[Path] = typer.Option(None, "--source"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri"),
    experiment: str = typer.Option("ablate", "--experiment"),
) -> None:
    """Print one receipt as JSON."""
    receipts, _, _ = _load_source(source, tracking_uri, experiment, None)
    matches = [r for r in receipts if r.identity.receipt_id.startswith(receipt_id)]
    if len(matches) != 1:
        _fail(f"receipt id {receipt_id!r} matches {len(matches)} receipts; give a longer, unique prefix")
    print(matches[0].model_dump_json(indent=2))


@receipts_app.command("sync")
def receipts_sync(
    sweep_dir: Path = typer.Argument(..., help="A sweep directory (its receipts/ and spool.jsonl are replayed)."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri"),
) -> None:
    """Bring MLflow to exactly the set of receipts on disk (idempotent by receipt id)."""
    from ablate.tracking.mlflow_store import sync

    result = sync(sweep_dir, default_tracking_uri(tracking_uri))
    console.print(result)


# --- promote ---


@app.command()
def promote(
    source: Optional[Path] = typer.Option(None, "--source", help="Receipt dir / JSON / JSONL (default: MLflow)."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri"),
    experiment: str = typer.Option("ablate", "--experiment"),
    sweep_name: Optional[list[str]] = typer.Option(None, "--sweep", help="Only these campaigns / sweep ids."),
    policy: Path = typer.Option(SEARCH_SPACES / "policies" / "default.yaml", "--policy"),
    defaults: Path = typer.Option(SEARCH_SPACES / "defaults.yaml", "--defaults"),
    out: Path = typer.Option(Path("reports"), "--out", help="Directory for the Markdown and JSON report."),
    write: bool = typer.Option(False, "--write", help="Update the defaults file in place with the evidence."),
    branch: Optional[str] = typer.Option(None, "--branch", help="Commit defaults + report on a new git branch."),
    open_pr: bool = typer.Option(False, "--open-pr", help="Open the PR with gh (or print the command)."),
) -> None:
    """Apply the promotion rule to the receipts and write a PR-ready report."""
    from ablate import promote as promotion

    receipts, rejected, links = _load_source(source, tracking_uri, experiment, sweep_name)
    if not receipts:
        _fail(f"no valid receipts found in {source or redact_uri(default_tracking_uri(tracking_uri))}"
              + (f" ({len(rejected)} rejected: {rejected[0][1]})" if rejected else ""))
    try:
        result = promotion.promote(receipts, policy_path=policy, defaults_path=defaults, rejected=rejected,
                                   run_links=links)
    except ConfigError as exc:
        _fail(str(exc))
    out.mkdir(parents=True, exist_ok=True)
    md_path = out / f"{result.report_id}.md"
    md_path.write_text(result.markdown)
    (out / f"{result.report_id}.json").write_text(result.to_json())
    print(result.markdown)  # raw: it is the PR body, and rich would re-wrap its tables
    console.print(f"\nreport: {md_path}", highlight=False)
    if write or branch:
        changed = promotion.write_defaults(result, defaults)
        console.print(f"defaults: {len(changed)} value(s) promoted in {defaults}", highlight=False)
    if branch:
        outcome = promotion.make_branch(result, branch, Path.cwd(), open_pr=open_pr)
        console.print(f"branch {branch}: commit {outcome.commit[:10]} ({', '.join(outcome.files)})", highlight=False)
        if outcome.pr_opened:
            console.print(outcome.pr_output, markup=False, highlight=False)
        elif outcome.pr_commands:
            console.print("open the pull request with:", highlight=False)
            for command in outcome.pr_commands:
                console.print(f"  {command}", markup=False, highlight=False)


# --- doctor ---


@app.command()
def doctor(
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri"),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address (default $RAY_ADDRESS)."),
) -> None:
    """Hardware (nvidia-ml-py), torch/CUDA, Ray and MLflow reachability, package versions."""
    from ablate.doctor import run_checks, versions

    table = Table("check", "ok", "detail")
    checks = run_checks(default_tracking_uri(tracking_uri), address)
    for check in checks:
        table.add_row(check.name, "[green]yes[/]" if check.ok else "[red]no[/]", check.detail)
    console.print(table)
    console.print(" ".join(f"{k}={v or '-'}" for k, v in versions().items()), highlight=False)
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


def main() -> None:
    try:
        app()
    except ConfigError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(2)
