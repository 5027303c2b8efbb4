"""Where the test suites find a MySQL or MariaDB server (required in CI)."""

from outbox_core.dialects.base.provision import Provision

PROVISION = Provision(
    "mysql",
    default_url="mysql+pymysql://root@127.0.0.1:3306/test",
    required_in_ci=True,
)
