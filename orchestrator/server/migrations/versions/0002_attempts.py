"""Attempts on the server: each job's attempts with outcome and booked spend (``dtrun server
import`` fills it from an embedded ``~/.dtrun``).

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "attempts",
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("n", sa.Integer, primary_key=True),
        sa.Column("provider", sa.String(40), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("outcome", sa.String(40)),
        sa.Column("reason", sa.Text),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("launched_at", sa.Float),
        sa.Column("ended_at", sa.Float),
        sa.Column("price_per_hour", sa.Float),
        sa.Column("seconds", sa.Float, nullable=False),
        sa.Column("spend_usd", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("attempts")
