"""Where the test suites find a PostgreSQL server (required in CI)."""

from outbox_core.dialects.base.provision import Provision

PROVISION = Provision(
    "postgresql",
    default_url="postgresql+psycopg://postgres@127.0.0.1:5432/test",
    required_in_ci=True,
)
