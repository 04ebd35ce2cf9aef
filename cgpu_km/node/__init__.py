"""`cgpu-node`: install cgpu_km on a node and register it with the container engines.

`dockerconf`, `containerdconf` and `podmanhooks` are the engines'
configuration edits as pure functions (`edits` their common form),
`record` what an install changed (so that uninstall restores it byte for
byte), `prefix` the self-contained prefix with its venv, `install` the
steps (units included) and `cli` the command.
"""
