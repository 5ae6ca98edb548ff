"""What rlplat-openenv registers: the environment ``openenv`` (an OpenEnv environment's episodes for the
``env`` agent loop). The ``blackbox`` loop's agent function, ``rlplat_openenv.agent:run``, is named by path
and needs no registration. Dotted paths only: listing plugins imports no OpenEnv."""

from rlplat.hookspecs import hookimpl

RLPLAT_PLUGIN_API = ">=1.2,<2"


@hookimpl
def register_environments(register):
    register("openenv", "rlplat_openenv.environment:OpenEnvEnvironment",
             config_schema="rlplat_openenv.environment:OpenEnvConfig",
             description="an OpenEnv environment's episode: each model turn stepped as an action, its rubric's rewards")
