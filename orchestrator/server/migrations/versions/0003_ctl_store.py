"""The controllers' state store in the server database (``orchestrator.server.ctlstore``):
``orchestrator.run.statedb``'s tables prefixed ``ctl_``, so replicas on several machines share
every job's attempts, nodes, events and booked spend through the database alone.

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

F, I, T = sa.Float, sa.Integer, sa.Text


def _cols(spec: str) -> list[sa.Column]:
    """``name:type[!]`` words: type F/I/T, ``!`` NOT NULL, ``=d`` a server default (NOT NULL)."""
    out = []
    for word in spec.split():
        name, _, rest = word.partition(":")
        default = rest.split("=")[1] if "=" in rest else None
        out.append(sa.Column(name, {"F": F, "I": I, "T": T}[rest[0]], nullable="!" not in rest and default is None,
                             server_default=default))
    return out


def upgrade() -> None:
    op.create_table(
        "ctl_jobs", sa.Column("name", T, primary_key=True),
        *_cols("state:T! reason:T spec_yaml:T! spec_path:T run_uri:T! providers:T created:F! updated:F! "
               "started_at:F finished_at:F deadline:F step:I steps:I loss:F tokens_per_s:F last_committed_step:I "
               "progress_time:F steps_lost:I=0 estimate_json:T budget_usd:F session_first_attempt:I=1 "
               "restarts_used:I=0 stop_target:T stop_reason:T stop_started:F stop_now:I=0 requested_action:T "
               "controller_pid:I controller_host:T controller_seen:F controller_log:T val_loss:F"))
    op.create_table(
        "ctl_attempts", sa.Column("job", T, primary_key=True), sa.Column("n", I, primary_key=True, autoincrement=False),
        *_cols("provider:T! offer_json:T! state:T! outcome:T reason:T created:F! launched_at:F running_at:F "
               "ended_at:F start_step:I end_step:I log_path:T nodes_json:T"))
    op.create_table(
        "ctl_nodes", sa.Column("id", I, primary_key=True, autoincrement=True),
        *_cols("job:T! attempt:I! provider:T! name:T! instance_id:T! region:T handle_json:T! state:T! created:F! "
               "terminate_requested:F terminated_at:F"))
    op.create_index("ctl_nodes_job", "ctl_nodes", ["job"])
    op.create_table(
        "ctl_events", sa.Column("id", I, primary_key=True, autoincrement=True),
        *_cols("job:T! time:F! type:T! message:T! data_json:T"))
    op.create_index("ctl_events_job", "ctl_events", ["job", "id"])
    op.create_table(
        "ctl_spend", sa.Column("job", T, primary_key=True), sa.Column("attempt", I, primary_key=True, autoincrement=False),
        *_cols("price_per_hour:F! billed_from:F! billed_until:F! seconds:F=0 usd:F=0 closed:I=0"))
    op.create_table("ctl_meta", sa.Column("key", T, primary_key=True), sa.Column("value", T, nullable=False))


def downgrade() -> None:
    for t in ("ctl_meta", "ctl_spend", "ctl_events", "ctl_nodes", "ctl_attempts", "ctl_jobs"):
        op.drop_table(t)
