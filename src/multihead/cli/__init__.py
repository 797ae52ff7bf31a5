"""The ``multihead`` command line: ``multihead inspect`` (more subcommands register in main.py)."""
