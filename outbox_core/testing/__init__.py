"""Test kits shipped with the toolkit, for code that plugs into it.

:mod:`outbox_core.testing.broker_contract`: the broker contract suite, for a
broker shipped from another package (``pip install 'outbox-toolkit[testing]'``).
"""

import pytest

# The contract's asserts explain a failure (pytest rewrites them) when this
# package is imported before the contract module, as its tests do.
pytest.register_assert_rewrite("outbox_core.testing.broker_contract")
