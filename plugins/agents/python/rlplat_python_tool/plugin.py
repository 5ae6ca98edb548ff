"""What rlplat-python-tool registers: the ``python`` tool."""

from rlplat.hookspecs import hookimpl

RLPLAT_PLUGIN_API = ">=1.2,<2"


@hookimpl
def register_tools(register):
    register("python", "rlplat_python_tool.tool:PythonTool", config_schema="rlplat_python_tool.tool:PythonToolConfig",
             description="runs Python code in a sandboxed child process (limits, timeout, no survivors)")
