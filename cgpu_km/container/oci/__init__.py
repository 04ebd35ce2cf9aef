"""`cgpu-container-runtime`: an OCI runtime in front of runc (or NVIDIA's runtime).

`argv` reads a runtime command line, `spec` edits an OCI config (the hooks,
simgpu's files), `settings` is the wrapper's configuration file, `runtime`
is the program itself (the only module here that does I/O).
"""
