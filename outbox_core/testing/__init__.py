"""Test kits shipped with the toolkit, for code that plugs into it.

:mod:`outbox_core.testing.broker_contract`: the broker contract suite, for a
broker shipped from another package (``pip install 'outbox-toolkit[testing]'``).
"""
