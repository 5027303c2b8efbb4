"""The toolkit's messages in a Django project's words: migrations create the tables.

The core's errors and the doctor's fixes name ``outbox install --db URL
--table NAME``, the generic command's way to create what is missing; in a
Django project Django's migrations do that, so the messages say
``python manage.py migrate`` instead.
"""

from __future__ import annotations

import re

#: What a Django project runs instead of ``outbox install`` (the tables, the columns added).
MIGRATE = "python manage.py migrate outbox_toolkit"

# `outbox install --db '<url>' --table NAME [--schema NAME]`, quoted or not, in backticks or
# not; a bare `outbox install`, in backticks or not. `outbox install --source wal` (log
# tailing's slot, which migrations do not make) is left alone.
_INSTALL = re.compile(
    r"(`?)outbox install --db (?:'[^']*'|\S+) --table [^\s`']+(?: --schema [^\s`']+)?\1"
    r"|(`?)outbox install\2(?! --)"
)


def django_wording(text: str) -> str:
    """``text`` with every ``outbox install --db ...`` replaced by ``manage.py migrate``."""
    return _INSTALL.sub(lambda m: f"`{MIGRATE}`" if m.group(0).startswith("`") else MIGRATE, text)
