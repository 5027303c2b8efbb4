"""``python -m compat_matrix``: see :mod:`compat_matrix.cli`."""

from compat_matrix.cli import main

if __name__ == "__main__":
    main()
