"""The `ember` command line."""
