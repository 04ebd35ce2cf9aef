"""`cgpu-node`: install cgpu_km on a node and register it with the container engines.

`dockerconf`, `containerdconf` and `podmanhooks` are the engines'
configuration edits as pure functions, `units` the systemd units,
`record` what an install changed (so that uninstall restores it byte for
byte), `venv` the self-contained prefix, `install` the steps and `cli` the
command.
"""
