"""The `skyspot` command line: a thin shell over the package (one module per command group)."""
