"""The command line: parses, checks, calls the engine, renders the record. Nothing else."""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from ._config import RUBRICS, RunConfig
from ._engine._store import Store, check_url, default_url, state_dir
from ._engine._supervisor import supervise
from ._errors import UserError
from ._loop import plan

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Durable agentic RL: every trial, judgment and training step survives crashes.",
)
_F = RunConfig.model_fields


def _help(name: str) -> str:
    return _F[name].description or ""


class _State:
    url: str = ""


_state = _State()


@app.callback()
def _main(
    db: Annotated[
        str | None,
        typer.Option("--db", envvar="DURABLE_RL_DB", help="State database URL (sqlite:///PATH or postgresql://...)."),
    ] = None,
) -> None:
    _state.url = db or default_url(Path.cwd())


def _fail(message: str) -> NoReturn:
    print(f"durable-rl: error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def _config(**fields: Any) -> RunConfig:
    try:
        return RunConfig(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]).replace("_", "-") if err["loc"] else "config"
        _fail(f"--{name}: {err['msg'].removeprefix('Value error, ')}")


def _existing_store() -> Store | None:
    try:
        return Store.open_existing(_state.url)
    except UserError as e:
        _fail(str(e))


def _run_or_fail(store: Store | None, run_id: str) -> Store:
    if store is None or store.run(run_id) is None:
        _fail(f"no run {run_id!r} in {_state.url}")
    return store


def _task_folder(tasks: Path | None) -> str | None:
    """The absolute folder of a valid Harbor task set, checked before anything is written."""
    if tasks is None:
        return None
    from ._harbor import TaskError, tasks_at

    try:
        tasks_at(str(tasks.resolve()))  # cached: plan() finds them loaded
    except TaskError as e:
        _fail(f"--tasks: {e}")
    return str(tasks.resolve())


def _prices(specs: list[str]) -> dict[str, tuple[float, float]]:
    prices = {}
    for spec in specs:
        model, _, pair = spec.rpartition("=")
        try:
            prompt, completion = (float(x) for x in pair.split(","))
        except ValueError:
            _fail(f"--price {spec!r}: expected MODEL=IN,OUT in USD per million tokens")
        if not model or prompt < 0 or completion < 0:
            _fail(f"--price {spec!r}: expected MODEL=IN,OUT with a model name and prices of 0 or more")
        prices[model] = (prompt, completion)
    return prices


def _new_run_id() -> str:
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _launch(config: RunConfig, run_id: str | None, as_json: bool) -> None:
    """Record a new run and supervise its driver to the end."""
    run_id = run_id or _new_run_id()
    if not run_id.strip() or "/" in run_id:
        _fail(f"--run-id {run_id!r}: must be non-empty and contain no '/'")
    try:
        check_url(_state.url)
        existing = Store.open_existing(_state.url)
        if existing is not None and existing.run(run_id) is not None:
            _fail(f"run {run_id!r} already exists; `durable-rl resume {run_id}` finishes it")
        store = Store.create(_state.url)
    except UserError as e:
        _fail(str(e))
    store.create_run(run_id, config.model_dump_json())
    _supervise_and_report(store, run_id, config, as_json)


def _supervise_and_report(store: Store, run_id: str, config: RunConfig, as_json: bool) -> None:
    lines = sys.stderr if as_json else sys.stdout
    if not as_json:
        source = f"tasks {config.tasks}, agent {config.agent}" if config.tasks else f"rubric {config.rubric}"
        n_trials = len(plan(config)[1](0))
        print(f"run {run_id}: {config.n_steps} steps x {n_trials} trials, {source}, state {_state.url}", flush=True)
    ok = supervise(run_id, _state.url, config.driver_retries, lines)
    summary = store.summary(run_id)
    report = _write_report(store, run_id)
    if as_json:
        print(json.dumps(summary))
    else:
        _print_summary(summary, config)
        print(f"report: {report}")
    if not ok:
        raise typer.Exit(1)


def _write_report(store: Store, run_id: str) -> Path:
    from ._report import write_report  # matplotlib is slow to import; only here

    path = state_dir(_state.url, Path.cwd()) / "reports" / f"{run_id}.html"
    write_report(path, store.summary(run_id), store.run(run_id), store.attempts(run_id), store.steps(run_id))
    return path


def _print_summary(summary: dict[str, Any], config: RunConfig) -> None:
    c = summary["counters"]
    print(
        f"run {summary['run_id']} {summary['status']}: {len(summary['steps'])}/{config.n_steps} steps, "
        f"trials {c['trials_ok']} ok / {c['trials_failed']} skipped, driver attempts {c['driver_attempts']}"
    )
    print(
        f"reused: {c['worlds_reused']} worlds, {c['generate_reused']} rollouts, {c['train_steps_reused']} train steps"
    )
    print(
        f"ran: {c['worlds_built']} world builds, {c['generate_executed']} rollout attempts, "
        f"{c['judge_task_attempts']} judge-task attempts, {c['judge_calls']} judge calls, "
        f"{c['train_steps_executed']} train-step attempts"
    )


_JSON = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout; logs go to stderr.")]


@app.command()
def train(
    run_id: Annotated[str | None, typer.Option(help="Id of the new run (default: generated).")] = None,
    n_steps: Annotated[int, typer.Option(help=_help("n_steps"))] = 3,
    n_worlds: Annotated[int, typer.Option(help=_help("n_worlds"))] = 3,
    prompts_per_step: Annotated[int, typer.Option(help=_help("prompts_per_step"))] = 3,
    n_samples: Annotated[int, typer.Option(help=_help("n_samples"))] = 2,
    lr: Annotated[float, typer.Option(help=_help("lr"))] = 2.0,
    rubric: Annotated[str, typer.Option(help=_help("rubric"))] = "v1",
    flaky_trial_rate: Annotated[float, typer.Option(help=_help("flaky_trial_rate"))] = 0.0,
    judge_flake_rate: Annotated[float, typer.Option(help=_help("judge_flake_rate"))] = 0.0,
    turn_latency: Annotated[float, typer.Option(help=_help("turn_latency"))] = 0.2,
    judge_latency: Annotated[float, typer.Option(help=_help("judge_latency"))] = 0.5,
    trial_timeout: Annotated[float, typer.Option(help=_help("trial_timeout"))] = 300.0,
    hang_trial: Annotated[list[str] | None, typer.Option(help=_help("hang_trials"))] = None,
    tasks: Annotated[
        Path | None, typer.Option(help="Folder of Harbor tasks to train on instead of secret-hunt.")
    ] = None,
    agent: Annotated[str, typer.Option(help=_help("agent"))] = "oracle",
    workspace: Annotated[str, typer.Option(help=_help("workspace"))] = "auto",
    sandbox_slots: Annotated[int, typer.Option(help=_help("sandbox_slots"))] = 16,
    judge_concurrency: Annotated[int, typer.Option(help=_help("judge_concurrency"))] = 16,
    policy: Annotated[str, typer.Option(help=_help("policy"))] = "bandit",
    policy_model: Annotated[str, typer.Option(help=_help("policy_model"))] = "policy",
    policy_adapter: Annotated[str | None, typer.Option(help=_help("policy_adapter"))] = None,
    policy_base_url: Annotated[
        str, typer.Option(envvar="DURABLE_RL_POLICY_BASE_URL", help=_help("policy_base_url"))
    ] = "http://127.0.0.1:8000/v1",
    policy_api_key_env: Annotated[str, typer.Option(help=_help("policy_api_key_env"))] = "OPENAI_API_KEY",
    policy_max_turns: Annotated[int, typer.Option(help=_help("policy_max_turns"))] = 12,
    judge: Annotated[str, typer.Option(help=_help("judge"))] = "simulated",
    judge_model: Annotated[str, typer.Option(help=_help("judge_model"))] = "judge",
    judge_base_url: Annotated[
        str, typer.Option(envvar="DURABLE_RL_JUDGE_BASE_URL", help=_help("judge_base_url"))
    ] = "http://127.0.0.1:8000/v1",
    judge_api_key_env: Annotated[str, typer.Option(help=_help("judge_api_key_env"))] = "OPENAI_API_KEY",
    judge_rpm: Annotated[int, typer.Option(help=_help("judge_rpm"))] = 600,
    judge_timeout: Annotated[float, typer.Option(help=_help("judge_timeout"))] = 60.0,
    judge_deadline: Annotated[float, typer.Option(help=_help("judge_deadline"))] = 600.0,
    price: Annotated[
        list[str] | None, typer.Option(help="MODEL=IN,OUT: USD per million prompt and completion tokens.")
    ] = None,
    crash_driver_at_step: Annotated[int, typer.Option(help=_help("crash_driver_at_step"))] = -1,
    driver_retries: Annotated[int, typer.Option(help=_help("driver_retries"))] = 2,
    as_json: _JSON = False,
) -> None:
    """Train: build the worlds, then run each step's trials, judge them and update the policy."""
    config = _config(
        n_steps=n_steps,
        n_worlds=n_worlds,
        prompts_per_step=prompts_per_step,
        n_samples=n_samples,
        lr=lr,
        rubric=rubric,
        flaky_trial_rate=flaky_trial_rate,
        judge_flake_rate=judge_flake_rate,
        turn_latency=turn_latency,
        judge_latency=judge_latency,
        trial_timeout=trial_timeout,
        hang_trials=hang_trial or [],
        workspace=workspace,
        tasks=_task_folder(tasks),
        agent=agent,
        policy=policy,
        policy_model=policy_model,
        policy_adapter=policy_adapter,
        policy_base_url=policy_base_url,
        policy_api_key_env=policy_api_key_env,
        policy_max_turns=policy_max_turns,
        judge=judge,
        judge_model=judge_model,
        judge_base_url=judge_base_url,
        judge_api_key_env=judge_api_key_env,
        judge_rpm=judge_rpm,
        judge_timeout=judge_timeout,
        judge_deadline=judge_deadline,
        prices=_prices(price or []),
        sandbox_slots=sandbox_slots,
        judge_concurrency=judge_concurrency,
        crash_driver_at_step=crash_driver_at_step,
        driver_retries=driver_retries,
    )
    _launch(config, run_id, as_json)


@app.command()
def rescore(
    rubric: Annotated[str, typer.Option(help=f"The new rubric: {', '.join(RUBRICS)}.")],
    from_run: Annotated[str | None, typer.Option("--from", help="Run to re-score (default: the latest).")] = None,
    run_id: Annotated[str | None, typer.Option(help="Id of the new run (default: generated).")] = None,
    as_json: _JSON = False,
) -> None:
    """Re-score a run with a new rubric: reuse every world and rollout whose inputs are unchanged."""
    if rubric not in RUBRICS:
        _fail(f"--rubric: unknown rubric {rubric!r}; known: {', '.join(RUBRICS)}")
    store = _existing_store()
    if from_run is None:
        runs = store.runs() if store is not None else []
        if not runs:
            _fail(f"no runs in {_state.url} to re-score")
        from_run = runs[-1].run_id
    source = _run_or_fail(store, from_run).run(from_run)
    assert source is not None
    config = _config(**{**source.config, "rubric": rubric, "crash_driver_at_step": -1, "source_run": from_run})
    if not as_json:
        print(f"re-scoring {from_run} with rubric {rubric}", flush=True)
    _launch(config, run_id, as_json)


@app.command()
def resume(run_id: Annotated[str, typer.Argument(help="The run to finish.")], as_json: _JSON = False) -> None:
    """Finish a run whose processes were killed: completed work is replayed, not redone."""
    store = _run_or_fail(_existing_store(), run_id)
    row = store.run(run_id)
    assert row is not None
    config = RunConfig.model_validate(row.config)
    if store.display_status(row) == "running":
        _fail(f"run {run_id!r} is still running (driver pid {store.attempts(run_id)[-1]['pid']})")
    if row.status == "succeeded" and not as_json:
        print(f"run {run_id} already succeeded; nothing to resume")
    if row.status != "succeeded":
        store.set_status(run_id, "running")
    _supervise_and_report(store, run_id, config, as_json)


@app.command()
def ledger(
    run_id: Annotated[str, typer.Argument(help="The run whose judge calls to account for.")], as_json: _JSON = False
) -> None:
    """The judge's ledger: calls made, tokens, cost, and what replay and reuse saved."""
    store = _run_or_fail(_existing_store(), run_id)
    book = store.ledger(run_id)
    if as_json:
        print(json.dumps(book))
        return
    saved = book["saved"]
    print(
        f"judge calls {book['judge_calls']} ({book['requests']} HTTP requests: {book['answered']} answered, "
        f"{book['failed_requests']} failed and retried, {book['lost_answers']} answers lost to a crash)"
    )
    print(f"tokens {book['prompt_tokens']} in / {book['completion_tokens']} out · cost ${book['cost_usd']:.6f}")
    print(
        f"saved by replay and reuse: {saved['calls']} calls, {saved['prompt_tokens']} in / "
        f"{saved['completion_tokens']} out tokens, ${saved['cost_usd']:.6f}"
    )


@app.command("runs")
def list_runs(as_json: _JSON = False) -> None:
    """List the runs in the state database."""
    store = _existing_store()
    rows = []
    for r in store.runs() if store is not None else []:
        rows.append(
            {
                "run_id": r.run_id,
                "status": store.display_status(r),  # type: ignore[union-attr]
                "steps_done": len(store.steps(r.run_id)),  # type: ignore[union-attr]
                "n_steps": r.config["n_steps"],
                "driver_attempts": len(store.attempts(r.run_id)),  # type: ignore[union-attr]
                "started": _iso(r.started_at or r.created_at),
                "rubric": r.config["rubric"],
                "source_run": r.config.get("source_run"),
            }
        )
    if as_json:
        print(json.dumps(rows))
        return
    table = Table("run", "status", "steps", "driver attempts", "started", "rubric", "from")
    for row in rows:
        table.add_row(
            row["run_id"],
            row["status"],
            f"{row['steps_done']}/{row['n_steps']}",
            str(row["driver_attempts"]),
            row["started"],
            row["rubric"],
            row["source_run"] or "",
        )
    Console().print(table)


@app.command()
def show(
    run_id: Annotated[str, typer.Argument(help="The run to show.")],
    show_trials: Annotated[bool, typer.Option("--trials", help="Show each trial's result instead.")] = False,
    as_json: _JSON = False,
) -> None:
    """Show a run: its steps and its counters, or with --trials each trial's result."""
    store = _run_or_fail(_existing_store(), run_id)
    if show_trials:
        _show_trials(store.trials(run_id), as_json)
        return
    summary = store.summary(run_id)
    if as_json:
        print(json.dumps(summary))
        return
    console = Console()
    steps = Table(
        "step",
        "trials",
        "mean reward",
        "mean turns",
        "weights",
        "wall s",
        "driver attempt",
        title=f"run {run_id} ({summary['status']})",
    )
    for s in store.steps(run_id):
        steps.add_row(
            str(s["step"]),
            f"{s['n_trials']}/{s['n_specs']}",
            f"{s['mean_reward']}",
            f"{s['mean_turns']}",
            f"v{s['weights_version']}",
            f"{s['wall_s']:.2f}",
            str(s["driver_attempt"]),
        )
    console.print(steps)
    counters = Table("counter", "value")
    for name, value in summary["counters"].items():
        counters.add_row(name, str(value))
    console.print(counters)


def _show_trials(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows))
        return
    table = Table("trial", "reward", "rewards", "error", "timings s", "reported")
    for t in rows:
        info = dict(t["info"])
        timings = info.pop("timings", {})
        error = f"{t['error_type']}: {t['error_message']}" if t["error_type"] else (t["error_message"] or "")
        table.add_row(
            t["trial_id"],
            "" if t["reward"] is None else f"{t['reward']}",
            ", ".join(f"{k}={v}" for k, v in t["rewards"].items()),
            error,
            ", ".join(f"{k} {v:.2f}" for k, v in timings.items()),
            ", ".join(f"{k}={v}" for k, v in info.items() if k != "rewards"),
        )
    Console().print(table)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def main() -> None:
    """Entry point of the `durable-rl` command."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
