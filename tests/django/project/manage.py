#!/usr/bin/env python
"""The test project's manage.py (settings: DJANGO_SETTINGS_MODULE, one module per database)."""

import os
import sys
from pathlib import Path

# The repository root, so that tests.django.project.* imports.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django.project.settings.sqlite")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
