"""The `tpuboot` commands, a module per feature. tpuboot/cli.py parses the command line and imports
only the chosen command's module, so each command loads what it needs and no more
(tests/unit/test_command_imports.py holds each one to its list)."""
