"""The first schema: teams, users, api_tokens, jobs, events, leases, team_secrets.

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(100), nullable=False, unique=True),
        sa.Column("monthly_usd", sa.Float),
    )
    op.create_table(
        "users",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("team_id", sa.Integer, sa.ForeignKey("teams.id"), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("role", sa.String(10), nullable=False),
        sa.UniqueConstraint("team_id", "name"),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id"), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("last_used", sa.Float),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("team_id", sa.Integer, sa.ForeignKey("teams.id"), nullable=False),
        sa.Column("user_id", sa.Integer, sa.ForeignKey("users.id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("plan", sa.JSON),
        sa.Column("state", sa.String(20), nullable=False, index=True),
        sa.Column("reason", sa.Text),
        sa.Column("requested_action", sa.String(20)),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("updated", sa.Float, nullable=False),
        sa.Column("spend_usd", sa.Float, nullable=False),
        sa.Column("booked_until", sa.Float),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("node_handle", sa.JSON),
        sa.Column("price_per_hour", sa.Float),
        sa.UniqueConstraint("team_id", "name"),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), nullable=False, index=True),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
    )
    op.create_table(
        "leases",
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("replica", sa.String(100)),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("epoch", sa.Integer, nullable=False),
    )
    op.create_table(
        "team_secrets",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("team_id", sa.Integer, sa.ForeignKey("teams.id"), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("ciphertext", sa.LargeBinary, nullable=False),
        sa.UniqueConstraint("team_id", "kind"),
    )


def downgrade() -> None:
    for t in ("team_secrets", "leases", "events", "jobs", "api_tokens", "users", "teams"):
        op.drop_table(t)
