"""
The spend a run plans, line by line (GPU-hours, its disk, the fixed charges), and what budget_file
says now: preflight prints both, and --dry_run_budget stops there, before a GPU-hour is paid for.
"""
from podgpt.core.schedule import Budget


def spend_lines(cfg, horizon):
    """The planned horizon's spend: [(line, how, dollars)], the total last; [] without a plan."""
    if not horizon:
        return []
    return Budget.of(cfg).lines(horizon["hours"], horizon["world"], cfg.plan_gpu or "GPU")


def budget_file_line(budget):
    """budget_file read now, and what the run's guard would do with it, in one line."""
    verdict = budget.file_verdict()
    if verdict is None:
        return f"budget_file {budget.budget_file}: unreadable (see the warning above)"
    limit, spent, projected = verdict
    then = {"budget_file_spent": "the run would exit at once, writing nothing",
            "budget_file_projected": "the run would stop with a checkpoint",
            None: ("the run would warn and go on" if spent > budget.warn_at() else
                   "the run would go on")}[limit]
    return (f"budget_file {budget.budget_file}: spent ${spent:.2f}, projected ${projected:.2f} "
            f"of budget_usd=${budget.budget_usd:.2f}: {then}")


def print_spend(cfg, plan):
    """The spend lines under preflight's gates; with dry_run_budget, budget_file's verdict too."""
    for line, how, usd in plan.get("spend", []):
        print(f"spend  {line:<8} ${usd:>9,.2f}  {how}")
    if cfg.dry_run_budget and cfg.budget_file:
        print(budget_file_line(Budget.of(cfg)))
