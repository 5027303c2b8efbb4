"""``python -m outbox_core.cli``: the ``outbox`` command."""

from outbox_core.cli import main

main()
