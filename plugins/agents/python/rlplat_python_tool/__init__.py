"""rlplat-python-tool: the ``python`` tool, running a model's code in a sandboxed child process
(:mod:`rlplat_python_tool.sandbox`). A distribution of its own: it runs untrusted code, and its threat model
and owner are its own."""
